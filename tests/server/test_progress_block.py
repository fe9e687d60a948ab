"""Layer-done signals without gRPC: a layer-wise reload publishes its layers into a slot of
the pool's progress block, which the client maps at registration and waits on; Watch is
only the fallback (a failed reload, a reused slot, a sidecar that offers no block)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from sidecar_util import filled_device, keys_for, mimo_geometries, pages_of

from hicache.api import KeyStatus, OpEvent, TransferResult
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.client.handles import ProgressSlot, ReloadHandle
from hicache.rpc.generated import hicache_pb2 as pb
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.progress_block import ProgressBlock
from hicache.transfer import native
from server import HiCacheServer, ServerConfig, create_server

pytestmark = pytest.mark.skipif(not native.available(), reason="progress blocks need the C extension")


@pytest.fixture
def served() -> Iterator[tuple[HiCacheServer, str]]:
    d = tempfile.mkdtemp(prefix="hc")
    srv, address = create_server(
        ServerConfig(
            socket=os.path.join(d, "hc.sock"),
            # every layer-wise reload goes layer by layer, however small (the path under test)
            service=ServiceConfig(expected=mimo_geometries(), layerwise_inline_bytes=0),
        )
    )
    yield srv, address
    srv.stop(0)
    shutil.rmtree(d, ignore_errors=True)


class NoWatch:
    """Stands in for the stub's Watch: counts calls and fails the test's reloads if used."""

    def __init__(self, real: Any):
        self.real, self.calls = real, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.real(*args, **kwargs)


def test_layer_waits_read_the_progress_block_not_watch(served: tuple[HiCacheServer, str]) -> None:
    _, address = served
    client = HiCacheClient(address, timeout=30)
    dev = filled_device(8, seed=1)
    pool = client.register(dev)
    assert client._blocks.slot(pool.pool_id, 0, 1, 1) is not None  # the block is mapped
    keys = keys_for(4, seed=2)
    want = pages_of(dev, [0, 1, 2, 3])
    client.offload(keys, [0, 1, 2, 3])
    watch = NoWatch(client._stub.Watch)
    client._stub.Watch = watch  # type: ignore[method-assign]
    for round_ in range(3):
        h = client.reload(keys, [4, 5, 6, 7], layerwise=True)
        assert h.statuses == (KeyStatus.LOADED,) * 4
        for layer in range(h.layer_num):
            h.wait_layer(layer, timeout=30)
        h.wait(30)
        assert h.done()
        for got, page in zip(pages_of(dev, [4, 5, 6, 7]), want, strict=True):
            assert torch.equal(got, page), round_
    assert watch.calls == 0, "a layer wait went through Watch"
    assert not h.gpu_waits  # CPU pools wait in the progress block, not on CUDA events
    client.close()


def test_cpu_pools_offer_no_cuda_events_and_refuse_a_ready_event(served: tuple[HiCacheServer, str]) -> None:
    _, address = served
    client = HiCacheClient(address, timeout=30)
    dev = filled_device(8, seed=4)
    pool = client.register(dev)
    secret = [("x-hicache-pool-secret", pool.secret)]
    keys = keys_for(2, seed=5)
    req = pb.OffloadRequest(request_id="ready-1", pool_id=pool.pool_id, keys=keys, device_pages=[0, 1], ready_event=3)
    with pytest.raises(grpc.RpcError) as err:
        client._stub.Offload(req, metadata=secret)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ready_event must be 0 or 1..0" in (err.value.details() or "")
    assert client.lookup(keys).prefix_length == 0  # nothing was stored
    client.offload(keys, [0, 1])
    r = client._stub.Reload(
        pb.ReloadRequest(request_id="lw-1", pool_id=pool.pool_id, keys=keys, device_pages=[2, 3], layerwise=True),
        metadata=secret,
    )
    assert r.event_layers == 0 and r.progress_words > 0
    client.close()


def test_a_failed_reload_is_reported_through_watch(served: tuple[HiCacheServer, str]) -> None:
    srv, address = served
    client = HiCacheClient(address, timeout=30)
    pool = client.register(filled_device(8, seed=1))
    keys = keys_for(2, seed=3)
    client.offload(keys, [0, 1])
    engine = srv.service.pool(pool.pool_id).engine  # type: ignore[attr-defined]

    def broken(*_: Any) -> None:
        raise RuntimeError("the copy broke")

    engine._copy_all_layers = broken
    h = client.reload(keys, [2, 3], layerwise=True)
    with pytest.raises(RuntimeError, match="the copy broke"):
        h.wait_layer(0, timeout=30)
    with pytest.raises(RuntimeError, match="the copy broke"):
        h.wait(30)
    client.close()


def test_a_reused_slot_falls_back_to_watch() -> None:
    row = np.zeros(16, dtype=np.uint32)
    row[0] = 7  # another reload's generation now
    events = [pb.WatchEvent(kind=pb.WatchEvent.KIND_LAYER_DONE, layer=0, layers_done=1, layer_num=2)]
    events.append(pb.WatchEvent(kind=pb.WatchEvent.KIND_DONE, layers_done=2, layer_num=2))
    watched: list[int] = []

    def watch() -> Any:
        watched.append(1)
        return iter(events)

    result = TransferResult((KeyStatus.LOADED,), 10, "op-1", False)
    h = ReloadHandle(result, 2, watch, ProgressSlot(row, generation=6, words=1))
    h.wait(10)
    assert watched == [1] and h.done()
    polled = ReloadHandle(result, 2, watch, ProgressSlot(row, generation=6, words=1))
    for _ in range(1000):  # done() alone, polled: it turns to Watch and learns the end there
        if polled.done():
            break
        time.sleep(0.01)
    assert polled.done() and watched == [1, 1]


class StubError(grpc.RpcError):
    """What the stub raises for a failed Watch (the status code and details gRPC gives)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


REFUSED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "every stream slot is held")  # for want of a stream slot
PAST_DEADLINE = (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")  # the stream outlived the timeout


def test_a_refused_watch_of_a_reload_seen_done_meanwhile_records_no_failure() -> None:
    result = TransferResult((KeyStatus.LOADED,), 10, "op-2", False)
    made, calls = threading.Event(), []

    def watch() -> Any:
        calls.append(1)
        assert made.wait(10)
        handle._on_event(OpEvent("done"))  # the progress slot saw the end while Watch was refused
        raise StubError(*REFUSED)

    handle = ReloadHandle(result, 2, watch)
    made.set()
    handle.wait(10)
    time.sleep(0.2)  # room for a wrong retry, or a "failed" recorded late
    handle.wait(10)  # no "failed" from the refusal
    assert handle.done() and calls == [1]  # and no Watch asked again


def test_slots_are_handed_out_oldest_first_with_new_generations() -> None:
    block = ProgressBlock(slots=2)
    try:
        a = block.acquire(2)
        b = block.acquire(20)  # capped at the slot's 15 words
        assert a is not None and b is not None and block.acquire(1) is None
        assert (a[0], b[0]) == (0, 1) and b[1] == a[1] + 1 and len(b[2]) == 15
        assert int(block.words[0, 0]) == a[1]
        block.release(a[0])
        c = block.acquire(1)
        assert c is not None and c[0] == 0 and c[1] == b[1] + 1 and int(block.words[0, 0]) == c[1]
        assert not c[2].array.any()  # zeroed for its new reload
    finally:
        block.close()


def test_a_watch_past_its_deadline_is_asked_again_while_the_sidecar_answers() -> None:
    result = TransferResult((KeyStatus.LOADED,), 10, "op-3", False)
    calls, probes = [], []

    def watch() -> Any:  # a reload longer than the stream's deadline: the first stream ends first
        calls.append(1)
        if len(calls) == 1:
            raise StubError(*PAST_DEADLINE)
        yield pb.WatchEvent(kind=pb.WatchEvent.KIND_DONE, layers_done=2, layer_num=2)

    handle = ReloadHandle(result, 2, watch, probe=lambda: probes.append(1))
    handle.wait(10)  # done, not "failed": it was reported failed while the copy went on
    assert handle.done() and calls == [1, 1] and probes == [1]


def test_a_watch_past_its_deadline_of_a_lost_sidecar_raises_that() -> None:
    result = TransferResult((KeyStatus.LOADED,), 10, "op-4", False)

    def watch() -> Any:
        raise StubError(*PAST_DEADLINE)

    def probe() -> None:
        raise HiCacheRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")

    handle = ReloadHandle(result, 2, watch, probe=probe)
    with pytest.raises(HiCacheRpcError, match="sidecar is lost: connection refused"):
        handle.wait(10)
    assert handle.done()
