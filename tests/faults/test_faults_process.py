"""Process faults: an engine that dies mid-reload, a sidecar killed with SIGKILL mid-offload.

Each test asserts that nothing acknowledged is lost and nothing wrong is served: pages the
sidecar acknowledged as durable (in the file tier) come back exact after a restart, pages
that lived only in host memory are reported missing, and every page served is compared
byte for byte with what the engine wrote.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sidecar_util import (
    all_zero,
    filled_device,
    keys_for,
    mimo_geometries,
    shm_exists,
    start_sidecar,
    wait_stored,
    zero_pages,
)

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.service import HiCacheService
from server import ServerConfig, create_server

ROOT = Path(__file__).resolve().parents[2]
S = KeyStatus


class FakeClock:
    """A monotonic clock the test advances by hand (lease expiry on demand)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


DYING_ENGINE = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, "tests")
    from sidecar_util import filled_device, keys_for
    from hicache.client import HiCacheClient
    dev = filled_device(32, seed=3)
    client = HiCacheClient(sys.argv[1], timeout=60)
    info = client.register(dev, model_id="MiMo-V2-Flash@main")
    keys = keys_for(16, seed=3)
    client.offload(keys, list(range(16)))
    client.pin(keys[:4])                                  # pins die with the engine too
    handle = client.reload(keys, list(range(16, 32)), layerwise=True)
    print(info.pool_id, info.host_shm_name, dev.handle.name, flush=True)
    handle.wait_layer(0, timeout=60)                      # the copy is under way ...
    os.kill(os.getpid(), signal.SIGKILL)                  # ... and the engine is gone
    """
)


def test_engine_killed_mid_reload_pages_and_lease_are_reclaimed(sockdir):
    clock = FakeClock()
    service = HiCacheService(ServiceConfig(expected=mimo_geometries(), lease_timeout_s=5.0), clock=clock)
    config = ServerConfig(socket=os.path.join(sockdir, "hc.sock"), service=service.config, reap_interval_s=0.05)
    srv, address = create_server(config, service)
    survivor = filled_device(8, seed=9)
    try:
        with HiCacheClient(address, timeout=60) as client:  # a second engine that stays alive
            client.register(survivor, namespace="other", model_id="MiMo-V2-Flash@main")
            mine = keys_for(4, seed=9, namespace="other")
            assert client.offload(mine, [0, 1, 2, 3]).statuses == (S.STORED,) * 4
            src = [survivor.read_page(p).clone() for p in range(4)]
            child = subprocess.run(
                [sys.executable, "-c", DYING_ENGINE, address], cwd=ROOT, capture_output=True, text=True, timeout=120
            )
            assert child.returncode == -signal.SIGKILL, child.stderr
            pool_id, host_shm, dev_shm = child.stdout.split()
            dead = service.pool(pool_id)
            for _ in range(2000):  # the orphaned reload runs to its end on its own
                if dead.stats().ops_in_flight == 0:
                    break
                time.sleep(0.01)
            assert dead.stats().ops_in_flight == 0
            assert all(dead.index.refs(k) == 0 for k in dead.index.keys())  # every read reference is back
            assert dead.cache.pinned_pages() == 4
            service.check_integrity()
            clock.t += 3.0
            client.lookup(mine)  # the survivor's calls keep its lease fresh
            clock.t += 3.0  # past the dead engine's lease only
            for _ in range(2000):
                if pool_id not in service.pool_ids:
                    break
                time.sleep(0.01)
            assert service.pool_ids == [client._default]
            assert not shm_exists(host_shm)  # its host memory is unlinked
            os.unlink(os.path.join("/dev/shm", dev_shm))  # the child's own segment (it never closed it)
            service.check_integrity()
            zero_pages(survivor, range(4, 8))
            assert client.reload(mine, [4, 5, 6, 7]).statuses == (S.LOADED,) * 4
            assert all(torch.equal(src[i], survivor.read_page(4 + i)) for i in range(4))
    finally:
        srv.stop(0)
        survivor.close()


def test_sidecar_killed_mid_offload_fails_fast_then_serves_only_durable_pages(sockdir):
    policy = ("--hicache-write-policy", "write_through_selective")  # stored on a page's second use
    proc, address = start_sidecar(sockdir, *policy)
    dev = filled_device(48, seed=5)
    src = {p: dev.read_page(p).clone() for p in range(32)}
    client = HiCacheClient(address, timeout=60)
    try:
        old = client.register(dev, model_id="MiMo-V2-Flash@main")
        durable, host_only = keys_for(8, seed=1), keys_for(8, seed=2)
        assert client.offload(durable, range(8)).statuses == (S.STORED,) * 8
        assert client.offload(durable, range(8)).statuses == (S.DEDUPLICATED,) * 8  # second use: stored
        wait_stored(client, 8)
        assert client.offload(host_only, range(8, 16)).statuses == (S.STORED,) * 8  # used once: host only
        assert client.lookup(host_only).tiers == (Tier.HOST,) * 8
        in_flight: dict[bytes, int] = {}  # keys an offload may have reached the sidecar with
        errors: list[HiCacheRpcError] = []
        first_done = threading.Event()

        def offload_loop() -> None:
            for i in range(10_000):
                ks = keys_for(16, seed=100 + i)
                in_flight.update(zip(ks, range(16, 32), strict=True))
                try:
                    client.offload(ks, range(16, 32))
                    client.offload(ks, range(16, 32))
                except HiCacheRpcError as exc:
                    errors.append(exc)
                    return
                first_done.set()

        worker = threading.Thread(target=offload_loop)
        worker.start()
        assert first_done.wait(60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        worker.join(60)
        assert not worker.is_alive() and len(errors) == 1
        assert errors[0].code.name == "UNAVAILABLE", errors[0]  # not DEADLINE_EXCEEDED: it failed fast
        err = pytest.raises(HiCacheRpcError, client.lookup, durable).value
        assert err.code.name == "UNAVAILABLE"

        proc, address = start_sidecar(sockdir, *policy)  # same socket, same tier folder
        new = client.register(dev, model_id="MiMo-V2-Flash@main")  # waits for the sidecar to come up
        assert new.pool_id != old.pool_id
        err = pytest.raises(HiCacheRpcError, client.lookup, durable, pool=old.pool_id).value
        assert err.code.name == "NOT_FOUND" and old.pool_id in err.details
        assert not list((Path(sockdir) / "tier").rglob("*.tmp"))  # torn writes were swept on start
        zero_pages(dev, range(32, 48))
        assert client.lookup(durable).tiers == (Tier.STORAGE,) * 8
        assert client.reload(durable, range(32, 40)).statuses == (S.LOADED_FROM_STORAGE,) * 8
        assert all(torch.equal(src[i], dev.read_page(32 + i)) for i in range(8))
        assert client.lookup(host_only).tiers == (Tier.NONE,) * 8  # host memory did not survive
        assert client.reload(host_only, range(40, 48)).statuses == (S.NOT_FOUND,) * 8
        assert all_zero(dev, range(40, 48))  # and nothing was written for them
        served = 0
        for key, page in in_flight.items():  # whatever of the interrupted work survived is exact
            if client.reload([key], [47]).statuses == (S.LOADED_FROM_STORAGE,):
                assert torch.equal(src[page], dev.read_page(47))
                served += 1
        assert served <= len(in_flight)
    finally:
        client.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        dev.close()
