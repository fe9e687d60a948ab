"""Storage faults under the sidecar service: the disk fills up under the file tier, Redis
hangs (SIGSTOP) or goes away. Host memory keeps serving, the tier reports the fault, and
nothing a tier serves afterwards differs from what was written."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sidecar_util import filled_device, keys, register, service, zero_pages
from tier_helpers import GEOMETRIES, RedisServer, identity

import hicache.storage.file as file_tier
from hicache.api import KeyStatus, Tier
from hicache.sidecar.service import HiCacheService
from hicache.storage import page_format as fmt

S = KeyStatus
G = GEOMETRIES["mimo_kv"]  # 20 KiB pages: a small tmpfs holds only a few
FITS = 3


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on a tmpfs that holds FITS stored pages; where mounting is not allowed (not
    root), a folder whose writes fail with ENOSPC once FITS pages are in it."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    page = fmt.stored_size(identity(G), b"k" * 32)
    size = (FITS * page // 4096 + 2) * 4096  # whole 4 KiB pages, a little room for folders
    mounted = (
        os.geteuid() == 0
        and (
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        ).returncode
        == 0
    )
    if not mounted:
        real = file_tier.write_file

        def write_file(path: Path, parts: list, fsync: bool) -> None:  # type: ignore[type-arg]
            if sum(1 for f in mnt.rglob("*") if f.suffix in (".page", ".tmp")) >= FITS:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(path, parts, fsync)

        monkeypatch.setattr(file_tier, "write_file", write_file)
    yield mnt
    if mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _settle(svc: HiCacheService, pool_id: str) -> None:
    assert svc.pool(pool_id).cache.flush(60)


def test_disk_full_writes_fail_cleanly_and_host_keeps_serving(tmp_path, small_disk):
    svc = service(small_disk)  # file tier in <small_disk>/tier
    dev = filled_device(8, geometry=G, seed=4)
    info = register(svc, dev)
    ks = keys(6)
    src = [dev.read_page(p).clone() for p in range(6)]
    assert svc.offload("o", info.pool_id, ks, range(6)).statuses == (S.STORED,) * 6  # acknowledged on host
    _settle(svc, info.pool_id)
    pool = svc.pool(info.pool_id)
    st = pool.cache.storage.stats()
    assert st.pages is not None and 1 <= st.pages < 6 and st.writes == st.pages
    assert st.write_failures == 6 - st.pages and st.no_space == st.write_failures
    assert "No space" in st.last_error
    assert not svc.stats(info.pool_id)[0].storage_healthy  # the tier reports the full disk
    assert not list(small_disk.rglob("*.tmp"))  # failed writes leave no partial files
    pool.cache.storage.check_integrity()
    zero_pages(dev, range(6, 8))
    assert svc.reload("r", info.pool_id, ks[:2], [6, 7]).statuses == (S.LOADED,) * 2  # served from host
    assert torch.equal(src[0], dev.read_page(6)) and torch.equal(src[1], dev.read_page(7))
    stored = [t == Tier.STORAGE for t in svc.lookup(info.pool_id, ks).tiers]
    assert not any(stored)  # all still on host
    assert svc.evict("e", info.pool_id, ks).statuses == (S.EVICTED,) * 6
    tiers = svc.lookup(info.pool_id, ks).tiers
    assert tiers.count(Tier.STORAGE) == st.pages and set(tiers) <= {Tier.STORAGE, Tier.NONE}
    for i, k in enumerate(ks):  # what the tier serves is exact; what it lacks is NOT_FOUND
        zero_pages(dev, [7])
        status = svc.reload(f"r{i}", info.pool_id, [k], [7]).statuses[0]
        assert status == (S.LOADED_FROM_STORAGE if tiers[i] == Tier.STORAGE else S.NOT_FOUND)
        assert torch.equal(dev.read_page(7), src[i]) if status == S.LOADED_FROM_STORAGE else not dev.read_page(7).any()
    for k in ks:  # space comes back: the next write succeeds and the tier is healthy again
        pool.cache.storage.delete(k)
    assert svc.offload("o2", info.pool_id, keys(1, seed=7), [0]).statuses == (S.STORED,)
    _settle(svc, info.pool_id)
    assert svc.stats(info.pool_id)[0].storage_healthy
    svc.check_integrity()
    svc.close()
    dev.close()


def _wait_health(svc: HiCacheService, pool_id: str, healthy: bool) -> None:
    for _ in range(1000):
        if svc.stats(pool_id)[0].storage_healthy == healthy:
            return
        time.sleep(0.02)
    raise AssertionError(f"storage_healthy never became {healthy}")


@pytest.mark.parametrize("fault", ["sigstop", "restart"])
def test_hung_or_stopped_redis_host_keeps_serving_then_reconnects(tmp_path, fault):
    redis = RedisServer(tmp_path)
    redis.start()
    extra = {"url": redis.url, "timeout_s": 2.0, "backoff_initial_s": 0.05, "backoff_max_s": 0.5}  # 2 s: a busy machine
    svc = service(tmp_path, "redis", extra=extra)
    dev = filled_device(8, geometry=G, seed=6)
    info, pid = None, ""
    try:
        info = register(svc, dev)
        pid = info.pool_id
        ks = keys(6)
        src = [dev.read_page(p).clone() for p in range(6)]
        assert svc.offload("a", pid, ks[:3], range(3)).statuses == (S.STORED,) * 3
        _settle(svc, pid)
        assert redis.proc is not None
        if fault == "sigstop":
            os.kill(redis.proc.pid, signal.SIGSTOP)  # alive, accepting, never answering
        else:
            redis.stop()
        assert svc.offload("b", pid, ks[3:], range(3, 6)).statuses == (S.STORED,) * 3  # never blocks
        _settle(svc, pid)  # the writes time out and are counted as failures
        _wait_health(svc, pid, False)
        zero_pages(dev, range(6, 8))
        assert svc.reload("r", pid, ks[4:], [6, 7]).statuses == (S.LOADED,) * 2  # host serves
        assert torch.equal(src[4], dev.read_page(6)) and torch.equal(src[5], dev.read_page(7))
        assert svc.lookup(pid, keys(1, seed=9)).tiers == (Tier.NONE,)  # a miss, not a hang or an error
        st = svc.pool(pid).cache.storage.stats()
        assert st.write_failures >= 1 and st.errors >= 1 and "redis" in st.last_error
        if fault == "sigstop":
            os.kill(redis.proc.pid, signal.SIGCONT)
        else:
            redis.start()  # an empty server: the pages stored before are gone, not wrong
        _wait_health(svc, pid, True)
        assert svc.evict("e", pid, ks).statuses == (S.EVICTED,) * 6
        for i, k in enumerate(ks):
            zero_pages(dev, [7])
            status = svc.reload(f"r{i}", pid, [k], [7]).statuses[0]
            if fault == "sigstop" and i < 3:
                assert status == S.LOADED_FROM_STORAGE  # acknowledged before the hang: still there
            assert status in (S.LOADED_FROM_STORAGE, S.NOT_FOUND)
            if status == S.LOADED_FROM_STORAGE:
                assert torch.equal(src[i], dev.read_page(7))
            else:
                assert not dev.read_page(7).any()
        svc.check_integrity()
    finally:
        if fault == "sigstop" and redis.proc is not None and redis.proc.poll() is None:
            os.kill(redis.proc.pid, signal.SIGCONT)
        svc.close()
        redis.stop()
        dev.close()
