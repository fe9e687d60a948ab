"""Engine-copy grants under a shared host cache (#46 points 2 and 3): a copy slowed past its
lease never finds its pages reused, a reload whose grant ended under it reports nothing
loaded, and no member can write a host page that another member reads."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import eventually, same_page
from sidecar_util import filled_device, keys_for, mimo_full
from sidecar_util import start_in_process as start

from hicache.api import KeyStatus, Tier
from hicache.cache.config import HiCacheConfig
from hicache.client import HiCacheClient
from hicache.memory import MemoryHandle, local_buffer
from hicache.pools import DeviceKVPool
from hicache.sidecar import grants

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 1.0
SLOW_S = 2.5  # the engine's copy: past the lease, while its KeepAlives go on
ENGINE = MemoryHandle("engine", 0)


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def private_device(num_pages: int, seed: int) -> DeviceKVPool:
    g = mimo_full()
    pool = DeviceKVPool(g, num_pages, memory=local_buffer(g.pool_bytes(num_pages)))
    gen = torch.Generator().manual_seed(seed)
    pool.flat.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8, generator=gen))
    return pool


def slowed(copy: Callable[..., int], started: threading.Event) -> Callable[..., int]:
    """`copy` that waits SLOW_S first (a paused engine, a swapped-out process)."""

    def run(*args: Any, **kw: Any) -> int:
        started.set()
        time.sleep(SLOW_S)
        return copy(*args, **kw)

    return run


def serve(sockdir: str, host_pages_ratio: float) -> tuple[Any, str]:
    hierarchy = HiCacheConfig(ratio=host_pages_ratio, storage_backend="none")
    return start(sockdir, lease_timeout_s=LEASE_S, hierarchy=hierarchy)


def test_an_offload_slowed_past_the_lease_keeps_its_pages_from_another_members_offload(sockdir: str) -> None:
    srv, address = serve(sockdir, 1.0)  # 8 host pages for the cache
    slow_dev, other_dev = private_device(8, seed=1), filled_device(8, seed=2)
    a, b = HiCacheClient(address, timeout=30), HiCacheClient(address, timeout=30)
    try:
        pa = a.register(slow_dev, model_id="m")  # private memory: the engine copies
        pb_ = b.register(other_dev, model_id="m")  # the same model: one host cache
        copier = a._copiers[pa.pool_id]
        started = threading.Event()
        copier.writer.offload = slowed(copier.writer.offload, started)  # type: ignore[method-assign]
        a_keys = keys_for(4, seed=10)
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(a.offload(a_keys, [0, 1, 2, 3], pool=pa)))
        t.start()
        assert started.wait(30)
        time.sleep(LEASE_S * 1.5)  # the grant is past its time; the reaper has looked at it
        b_keys = keys_for(8, seed=20)
        stored = b.offload(b_keys, list(range(8)), pool=pb_).statuses
        assert stored.count(KeyStatus.STORED) == 4 and stored.count(KeyStatus.NO_SPACE) == 4, stored
        t.join(60)
        assert result and result[0].statuses == (KeyStatus.STORED,) * 4
        kept = [i for i, s in enumerate(stored) if s == KeyStatus.STORED]
        back = b.reload([b_keys[i] for i in kept], [0, 1, 2, 3], pool=pb_)
        # b's pages are b's bytes, not the late copy's (the old grant freed a's pages at its time)
        assert kept == [0, 1, 2, 3] and back.statuses == (KeyStatus.LOADED,) * 4
        for i in range(4):
            assert same_page(other_dev, i, filled_device(8, seed=2), i)
        check = private_device(8, seed=3)
        a2 = a.register(check, model_id="m")
        assert a.reload(a_keys, [4, 5, 6, 7], pool=a2).statuses == (KeyStatus.LOADED,) * 4
        for src, dst in zip(range(4), range(4, 8), strict=True):
            assert same_page(slow_dev, src, check, dst)
        assert srv.service.pool(pa.pool_id).grants.overdue == 1
        srv.service.check_integrity()
    finally:
        a.close()
        b.close()
        srv.stop(0)


def slow_reload_started(a: HiCacheClient, dev: DeviceKVPool, seed: int) -> tuple[Any, list[bytes], Any, list[Any]]:
    """Register `dev`, offload 4 keys from pages 0-3, and start (in a thread) their reload
    into pages 4-7, slowed past the lease; returns once the slowed copy has begun: (pool,
    keys, thread, [the reload's result, once the thread is done])."""
    pa = a.register(dev, model_id="m")
    keys = keys_for(4, seed=seed)
    assert a.offload(keys, [0, 1, 2, 3], pool=pa).statuses == (KeyStatus.STORED,) * 4
    copier = a._copiers[pa.pool_id]
    started = threading.Event()
    copier.engine.reload = slowed(copier.engine.reload, started)  # type: ignore[method-assign]
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(a.reload(keys, [4, 5, 6, 7], pool=pa)))
    t.start()
    assert started.wait(30)
    return pa, keys, t, result


def test_a_reload_slowed_past_the_lease_is_exact_and_its_pages_stay_held(sockdir: str) -> None:
    srv, address = serve(sockdir, 1.0)
    dev = private_device(8, seed=4)
    a = HiCacheClient(address, timeout=30)
    try:
        pa, keys, t, result = slow_reload_started(a, dev, seed=11)
        time.sleep(LEASE_S * 1.5)
        # held past its time: not evictable, not reusable
        assert a.evict(keys, pool=pa).statuses == (KeyStatus.BUSY,) * 4
        t.join(60)
        assert result[0].statuses == (KeyStatus.LOADED,) * 4
        for src, dst in zip(range(4), range(4, 8), strict=True):
            assert same_page(dev, src, dev, dst)
        assert a.evict(keys, pool=pa).statuses == (KeyStatus.EVICTED,) * 4  # EndCopy let go
    finally:
        a.close()
        srv.stop(0)


def test_a_reload_whose_grant_ends_with_its_pool_mid_copy_reports_nothing_loaded(sockdir: str) -> None:
    srv, address = serve(sockdir, 1.0)
    dev = private_device(8, seed=5)
    a = HiCacheClient(address, timeout=30)
    try:
        pa, _, t, result = slow_reload_started(a, dev, seed=12)
        srv.service.abandon(pa.pool_id)  # the pool goes (a lease the sidecar saw run out)
        t.join(60)
        assert result[0].statuses == (KeyStatus.NOT_FOUND,) * 4 and result[0].bytes_copied == 0
    finally:
        a.close()
        srv.stop(0)


def test_an_offload_larger_than_the_window_goes_in_parts(sockdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grants, "WINDOW_BYTES", 3 * mimo_full().page_bytes)  # a window of 3 pages
    srv, address = serve(sockdir, 2.0)
    dev = private_device(8, seed=6)
    a = HiCacheClient(address, timeout=30)
    try:
        pa = a.register(dev, model_id="m")
        copier = a._copiers[pa.pool_id]
        assert copier.window.num_pages == 3
        sizes: list[int] = []
        begin = copier._begin

        def counted(keys: Any, offload: bool) -> Any:
            sizes.append(len(keys))
            return begin(keys, offload)

        copier._begin = counted
        keys = keys_for(8, seed=13)
        assert a.offload(keys, list(range(8)), pool=pa).statuses == (KeyStatus.STORED,) * 8
        assert sizes == [3, 3, 2] and a.lookup(keys, pool=pa).tiers == (Tier.HOST,) * 8
        back = private_device(8, seed=99)
        a2 = a.register(back, model_id="m")
        assert a.reload(keys, list(range(8)), pool=a2).statuses == (KeyStatus.LOADED,) * 8
        assert torch.equal(back.flat, dev.flat)
        with pytest.raises(ValueError, match="4 keys in one offload grant, but the copy window holds 3 pages"):
            srv.service.begin_copy("big", pa.pool_id, keys_for(4, seed=14), offload=True)
        assert srv.service.pool(pa.pool_id).index.reserved_pages == 0
    finally:
        a.close()
        srv.stop(0)


SCRIBBLER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    from hicache.client import HiCacheClient
    from hicache.memory import local_buffer
    from hicache.pools import DeviceKVPool
    from sidecar_util import keys_for, mimo_full
    g = mimo_full()
    dev = DeviceKVPool(g, 4, memory=local_buffer(g.pool_bytes(4)))
    client = HiCacheClient(sys.argv[1], timeout=10)
    info = client.register(dev, model_id="m")
    grant = client.begin_copy(keys_for(2, seed=int(sys.argv[2])), offload=False, pool=info)
    assert grant.host_pages, grant
    print("granted", grant.host_pages, flush=True)
    host = client._copiers[info.pool_id].host
    host.flat[host.layout.page_spans([grant.host_pages[0]])[0][0]] = 7  # faults: mapped read-only
    print("wrote", flush=True)
    """
)


def test_a_member_cannot_write_the_host_pages_another_member_reads(sockdir: str) -> None:
    srv, address = serve(sockdir, 1.0)
    victim_dev = filled_device(8, seed=7)
    victim = HiCacheClient(address, timeout=30)
    try:
        pv = victim.register(victim_dev, model_id="m")
        keys = keys_for(2, seed=15)
        assert victim.offload(keys, [0, 1], pool=pv).statuses == (KeyStatus.STORED,) * 2
        out = subprocess.run(
            [sys.executable, "-c", SCRIBBLER, address, "15"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert "granted" in out.stdout and "wrote" not in out.stdout, (out.stdout, out.stderr[-2000:])
        assert out.returncode == -11, (out.returncode, out.stderr[-2000:])  # SIGSEGV: a read-only mapping
        assert victim.reload(keys, [2, 3], pool=pv).statuses == (KeyStatus.LOADED,) * 2
        assert same_page(victim_dev, 0, victim_dev, 2) and same_page(victim_dev, 1, victim_dev, 3)
        eventually(lambda: len(srv.service.pool_ids) == 1, 30, "the dead member's pool to go with its lease")
    finally:
        victim.close()
        srv.stop(0)


def test_a_write_into_the_window_after_its_grant_ended_changes_no_host_page(sockdir: str) -> None:
    srv, address = serve(sockdir, 1.0)
    dev, reader_dev = private_device(8, seed=8), filled_device(8, seed=9)
    a, b = HiCacheClient(address, timeout=30), HiCacheClient(address, timeout=30)
    try:
        pa = a.register(dev, model_id="m")
        pb_ = b.register(reader_dev, model_id="m")
        keys = keys_for(2, seed=16)
        assert a.offload(keys, [0, 1], pool=pa).statuses == (KeyStatus.STORED,) * 2
        a._copiers[pa.pool_id].window.flat.fill_(0xAB)  # a late (or buggy) write into its own window
        assert b.reload(keys, [4, 5], pool=pb_).statuses == (KeyStatus.LOADED,) * 2
        assert same_page(dev, 0, reader_dev, 4) and same_page(dev, 1, reader_dev, 5)
    finally:
        a.close()
        b.close()
        srv.stop(0)


def test_an_engine_copy_offload_waits_for_host_pages_queued_for_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache.sidecar.config import ServiceConfig
    from hicache.sidecar.service import HiCacheService
    from hicache.storage.file import FileTier

    write = FileTier.batch_set

    def slow(self: FileTier, items: Any) -> list[bool]:
        time.sleep(0.05)  # a disk behind the offloads, but writing
        return write(self, items)

    monkeypatch.setattr(FileTier, "batch_set", slow)
    hierarchy = HiCacheConfig(ratio=1.0, storage_backend="file", extra_config={"dir": str(tmp_path / "tier")})
    svc = HiCacheService(ServiceConfig(hierarchy=hierarchy))
    try:
        info = svc.register("r", geometry=mimo_full(), device_pages=8, device_memory=ENGINE, model_id="m")
        pid = info.pool_id  # type: ignore[union-attr]
        for seed in (1, 2):  # the second batch finds every host page queued for its write
            grant = svc.begin_copy(f"b{seed}", pid, keys_for(8, seed=seed), offload=True)
            assert grant.statuses == (KeyStatus.STORED,) * 8, (seed, grant.statuses)
            svc.end_copy(f"e{seed}", pid, grant.grant_id, commit=True)
        (st,) = svc.stats(pid)
        assert st.offload_no_space == 0 and st.writes_dropped == 0
        svc.check_integrity()
    finally:
        svc.close()
