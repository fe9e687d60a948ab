"""The client after the sidecar went away or forgot something: a wait in a progress slot
whose sidecar died, a reload whose slot was reused and whose operation was pruned, and an
unregister of a pool the sidecar no longer knows."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from sidecar_util import filled_device, keys_for, start_in_process

from hicache.client import HiCacheClient, HiCacheRpcError, ReloadHandle, ReloadOutcomeUnknown
from hicache.sidecar.progress_block import SLOTS
from hicache.transfer import native

needs_native = pytest.mark.skipif(not native.available(), reason="progress blocks need the C extension")


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after 60 s"
        time.sleep(0.005)


def copied(h: ReloadHandle) -> bool:
    """Whether the slot shows every layer done (read directly: the handle learns nothing)."""
    assert h._slot is not None
    return h._slot.words.done() >= h.layer_num


def wait_in_thread(h: ReloadHandle) -> BaseException | None:
    """h.wait() with no timeout, in a thread given a generous minute: what it raised."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            h.wait()
            raised.append(None)
        except BaseException as exc:
            raised.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "wait() still blocked a minute after the sidecar went away"
    return raised[0]


@needs_native
@pytest.mark.parametrize("restart", [False, True], ids=["killed", "restarted"])
def test_a_slot_wait_raises_when_the_sidecar_goes_away(sockdir: str, restart: bool) -> None:
    srv, address = start_in_process(sockdir, layerwise_inline_bytes=0)
    client = HiCacheClient(address, timeout=30)
    try:
        client.register(filled_device(4, seed=1))
        keys = keys_for(2, seed=2)
        client.offload(keys, [0, 1])
        h = client.reload(keys, [2, 3], layerwise=True)
        assert h._slot is not None
        until(lambda: copied(h), "copied")  # nothing writes the slot from now on
        srv.stop(0)
        h._slot.words.array[:] = 0  # what a sidecar killed before its first layer leaves
        if restart:  # a new sidecar on the same socket: it knows no pool
            srv, address = start_in_process(sockdir, layerwise_inline_bytes=0)
        err = wait_in_thread(h)
        assert isinstance(err, HiCacheRpcError), err
        assert err.code == (grpc.StatusCode.NOT_FOUND if restart else grpc.StatusCode.UNAVAILABLE)
        assert h.op_id in err.details
        assert h.done()
        with pytest.raises(HiCacheRpcError):
            h.wait_layer(0, timeout=30)  # remembered, not probed again
    finally:
        client.close()
        srv.stop(0)


@needs_native
def test_a_reload_seen_done_stays_done_after_its_slot_is_reused(sockdir: str) -> None:
    srv, address = start_in_process(sockdir, layerwise_inline_bytes=0, finished_ops_kept=1)
    client = HiCacheClient(address, timeout=30)
    try:
        client.register(filled_device(4, seed=1))
        keys = keys_for(1, seed=2)
        client.offload(keys, [0])
        seen = client.reload(keys, [1], layerwise=True)
        until(lambda: copied(seen), "copied")
        seen.wait_layer(0, timeout=30)  # reads the slot while it is still the reload's: all done
        unseen = client.reload(keys, [1], layerwise=True)  # never looked at while its slot was its own
        until(lambda: copied(unseen), "copied")
        for _ in range(SLOTS + 2):  # reuses both slots; the sidecar prunes both operations
            client.reload(keys, [2], layerwise=True).wait(30)
        assert seen._slot is not None and not seen._slot.current()
        assert unseen._slot is not None and not unseen._slot.current()
        seen.wait(30)
        assert seen.done()
        with pytest.raises(ReloadOutcomeUnknown, match=f"{unseen.op_id}: outcome unknown"):
            unseen.wait(30)
        with pytest.raises(ReloadOutcomeUnknown):
            unseen.wait_layer(0, timeout=30)
    finally:
        client.close()
        srv.stop(0)


def test_unregister_of_a_pool_the_sidecar_forgot_drops_it_here(sockdir: str) -> None:
    srv, address = start_in_process(sockdir)
    client = HiCacheClient(address, timeout=30)
    dev = filled_device(4, seed=1)
    try:
        old = client.register(dev)
        srv.stop(0)
        srv, address = start_in_process(sockdir)  # restarted: it knows no pool
        assert client.unregister(old) is False
        assert old.pool_id not in client._pools and old.pool_id not in client._secrets
        assert client._default is None and client._blocks.slot(old.pool_id, 0, 1, 1) is None
        with pytest.raises(KeyError, match=old.pool_id):
            client.unregister(old)  # gone here too: no second NOT_FOUND
        new = client.register(dev)
        assert client.unregister(new) is True
        assert client._pools == {} and client._secrets == {}
        stale = client.register(dev)
        assert client.forget(stale) is True and client.forget(stale) is False
        assert client._pools == {} and client._secrets == {}
    finally:
        client.close()
        srv.stop(0)
        dev.close()
