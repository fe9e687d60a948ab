"""Copy path "engine": memory the sidecar cannot map (private memory) is copied by the engine
itself, between its memory and the sidecar's host pool, with pages granted and published by
the sidecar. Reloads are bit-exact, an offload is visible only once committed, and an engine
that dies mid-copy leaves nothing visible and nothing held."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import eventually, page_bytes, same_page
from sidecar_util import filled_device, keys_for, make_service, mimo_full
from sidecar_util import start_in_process as start

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient
from hicache.memory import MemoryHandle, local_buffer
from hicache.pools import DeviceKVPool
from hicache.sidecar.errors import UnknownId
from hicache.sidecar.service import PoolInfo

ROOT = Path(__file__).resolve().parents[2]
ENGINE = MemoryHandle("engine", 0)


def private_device(num_pages: int = 8, seed: int = 0) -> DeviceKVPool:
    """A CPU device pool in private memory (as vLLM's CPU worker allocates its KV cache)."""
    g = mimo_full()
    pool = DeviceKVPool(g, num_pages, memory=local_buffer(g.pool_bytes(num_pages)))
    pool.flat.copy_(
        torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    )
    return pool


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_grants_publish_an_offload_only_when_committed_and_release_a_reload() -> None:
    svc = make_service()
    try:
        info = svc.register("r", geometry=mimo_full(), device_pages=8, device_memory=ENGINE)
        assert isinstance(info, PoolInfo)
        pid, ks = info.pool_id, keys_for(4)
        (stats,) = svc.stats(pid)
        assert stats.copy_path == "engine" and stats.device_pages == 8
        with pytest.raises(ValueError, match="copies in the engine"):
            svc.offload("o", pid, ks, [0, 1, 2, 3])
        with pytest.raises(ValueError, match="copies in the engine"):
            svc.reload("l", pid, ks, [0, 1, 2, 3])
        grant = svc.begin_copy("b1", pid, ks[:3], offload=True)
        assert grant.statuses == (KeyStatus.STORED,) * 3 and len(set(grant.host_pages)) == 3 and grant.grant_id
        assert svc.lookup(pid, ks[:3]).tiers == (Tier.NONE,) * 3  # not visible before the commit
        assert svc.begin_copy("b2", pid, ks[:3], offload=True).statuses == (KeyStatus.DEDUPLICATED,) * 3
        assert svc.begin_copy("b3", pid, ks[:1], offload=False).statuses == (KeyStatus.NOT_FOUND,)
        assert svc.end_copy("e1", pid, grant.grant_id, commit=True, copy_seconds=0.001) == 3
        assert svc.lookup(pid, ks[:3]).tiers == (Tier.HOST,) * 3
        with pytest.raises(UnknownId, match="already ended"):
            svc.end_copy("e2", pid, grant.grant_id, commit=True)
        aborted = svc.begin_copy("b4", pid, ks[3:], offload=True)
        svc.end_copy("e3", pid, aborted.grant_id, commit=False)
        assert svc.lookup(pid, ks).tiers == (Tier.HOST,) * 3 + (Tier.NONE,)
        load = svc.begin_copy("b5", pid, ks, offload=False)
        assert load.statuses == (KeyStatus.LOADED,) * 3 + (KeyStatus.NOT_FOUND,)
        assert svc.evict("v", pid, ks[:1]).statuses == (KeyStatus.BUSY,)  # held while the engine reads
        svc.end_copy("e4", pid, load.grant_id, commit=True)
        assert svc.evict("v2", pid, ks[:1]).statuses == (KeyStatus.EVICTED,)
        (stats,) = svc.stats(pid)
        assert stats.offload_bytes == 3 * mimo_full().page_bytes and stats.ops_in_flight == 0
        svc.check_integrity()
    finally:
        svc.close()


def test_a_grant_past_its_time_is_reported_and_keeps_its_pages_until_ended_or_released() -> None:
    now = [0.0]
    svc = make_service(lease_timeout_s=5.0)
    try:
        info = svc.register("r", geometry=mimo_full(), device_pages=8, device_memory=ENGINE)
        assert isinstance(info, PoolInfo)
        pool = svc.pool(info.pool_id)
        pool.grants._clock = lambda: now[0]
        ks = keys_for(2)
        grant = svc.begin_copy("b", info.pool_id, ks, offload=True)
        held = svc.begin_copy("b2", info.pool_id, keys_for(2, seed=1), offload=True)
        assert pool.index.reserved_pages == 4
        now[0] = 6.0
        svc.reap_expired()  # the reaper's tick reports late grants, once
        svc.reap_expired()
        assert pool.grants.overdue == 2 and pool.index.reserved_pages == 4 and len(pool.grants) == 2
        assert svc.lookup(info.pool_id, ks).tiers == (Tier.NONE,) * 2
        window = pool.grants.window
        assert window is not None and sorted(grant.host_pages + held.host_pages) == [0, 1, 2, 3]
        for slot in grant.host_pages:
            window.write_page(slot, bytes([slot + 1]) * window.geometry.page_bytes)
        assert svc.end_copy("e", info.pool_id, grant.grant_id, commit=True) == 2  # late, but its pages were kept
        assert svc.lookup(info.pool_id, ks).tiers == (Tier.HOST,) * 2
        host_pages = [pool.index.page_of(k) for k in ks]
        for slot, page in zip(grant.host_pages, host_pages, strict=True):
            assert bytes(pool.host.read_page(page).numpy()) == bytes([slot + 1]) * window.geometry.page_bytes
        assert svc.unregister("u", info.pool_id)  # the release ends the other one, as failed
        assert window.memory.closed
    finally:
        svc.close()


def test_memory_kind_engine_takes_no_layout() -> None:
    svc = make_service()
    try:
        with pytest.raises(ValueError, match="kind 'engine' takes no device_layout"):
            svc.register(
                "r", geometry=mimo_full(), device_pages=8, device_memory=ENGINE, device_layout="sglang_page_first"
            )
        assert svc.pool_ids == []
    finally:
        svc.close()


def test_a_private_pool_is_registered_with_the_engine_copy_path_and_reloads_bit_exact(sockdir: str) -> None:
    srv, address = start(sockdir)
    dev, other = private_device(8, seed=1), filled_device(8, seed=2)
    try:
        with HiCacheClient(address, timeout=10) as client:
            info = client.register(dev)  # private memory: chosen automatically
            (stats,) = client.stats(info)
            assert stats.copy_path == "engine"
            ks = keys_for(4, seed=5)
            before = dev.flat.clone()
            assert client.offload(ks, [0, 2, 4, 6], pool=info).statuses == (KeyStatus.STORED,) * 4
            assert torch.equal(dev.flat, before)  # the source is unchanged
            assert client.lookup(ks, pool=info).tiers == (Tier.HOST,) * 4
            page0 = [t.clone() for t in page_bytes(dev, 0)]
            handle = client.reload(ks + keys_for(1, seed=9), [1, 3, 5, 7, 0], layerwise=True, pool=info)
            assert handle.statuses == (KeyStatus.LOADED,) * 4 + (KeyStatus.NOT_FOUND,)
            handle.wait_layer(0)
            handle.wait()
            for src, dst in ((0, 1), (2, 3), (4, 5), (6, 7)):
                assert same_page(dev, src, dev, dst)
            assert all(
                torch.equal(a, b) for a, b in zip(page_bytes(dev, 0), page0, strict=True)
            )  # NOT_FOUND: untouched
            # a shared pool beside it still has the sidecar copy
            shared = client.register(other)
            (s2,) = client.stats(shared)
            assert s2.copy_path == "sidecar"
            with pytest.raises(ValueError, match="3 device pages"):
                client.offload(ks[:2], [0, 1, 2], pool=info)  # refused before anything is granted
            (stats,) = client.stats(info)
            assert (
                stats.offload_bytes == 4 * dev.geometry.page_bytes and stats.reload_bytes == 4 * dev.geometry.page_bytes
            )
    finally:
        srv.stop(0)
        other.close()


CRASHING_ENGINE = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, "tests")
    from hicache.client import HiCacheClient
    from hicache.pools import DeviceKVPool
    from hicache.memory import local_buffer
    from sidecar_util import keys_for, mimo_full
    g = mimo_full()
    dev = DeviceKVPool(g, 4, memory=local_buffer(g.pool_bytes(4)))
    client = HiCacheClient(sys.argv[1], timeout=10)
    info = client.register(dev)
    grant = client.begin_copy(keys_for(2, seed=3), offload=True, pool=info)
    print(info.pool_id, flush=True)
    os._exit(9)  # mid-copy: the grant is never ended
    """
)


def test_an_engine_killed_mid_copy_leaves_nothing_visible_and_its_pool_goes_with_the_lease(sockdir: str) -> None:
    srv, address = start(sockdir, lease_timeout_s=1.0)
    try:
        out = subprocess.run(
            [sys.executable, "-c", CRASHING_ENGINE, address], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        pool_id = out.stdout.split()[0]
        svc = srv.service
        pool = svc.pool(pool_id)
        assert pool.index.reserved_pages == 2  # reserved, never published
        with HiCacheClient(address, timeout=10) as witness:  # another engine sees nothing of it
            witness.attach(pool_id, pool.identity.secret)
            assert witness.lookup(keys_for(2, seed=3), pool=pool_id).tiers == (Tier.NONE,) * 2
        eventually(lambda: pool_id not in svc.pool_ids, 30, "the pool's release with its lease")
        assert pool.closed
    finally:
        srv.stop(0)
