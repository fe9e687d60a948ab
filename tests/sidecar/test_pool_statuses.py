"""RegisteredPool answers: prefetch statuses per key, and a refused reload that changes nothing."""

import numpy as np
import pytest
from sidecar_util import filled_device
from tier_helpers import GEOMETRIES, MemoryTier, identity, key, payload

from hicache.api import KeyStatus as S
from hicache.api import Tier
from hicache.cache.tiering import HierarchicalCache
from hicache.pools import HostKVPool
from hicache.sidecar.pool import RegisteredPool
from hicache.sidecar.registration import PoolIdentity
from hicache.sidecar.shared_cache import SharedHostCache

G = GEOMETRIES["mimo_kv"]


def pool_over(tier: MemoryTier, host_pages: int, **kw) -> RegisteredPool:  # type: ignore[no-untyped-def]
    cache = HierarchicalCache(HostKVPool(G, host_pages, "page_first"), tier, **kw)
    ident = PoolIdentity("p", "full", "", "m", "sha256", 32)
    return RegisteredPool(
        ident, filled_device(4, geometry=G), SharedHostCache(None, cache), max_batch=64, finished_ops_kept=8
    )


def stored_tier(n: int) -> tuple[MemoryTier, list[bytes]]:
    tier = MemoryTier(identity(G))
    ks = [key(i) for i in range(n)]
    for i, k in enumerate(ks):
        tier.set(k, payload(G, i))
    return tier, ks


def test_prefetch_of_keys_an_earlier_prefetch_is_fetching_says_fetching():
    tier, ks = stored_tier(4)
    rp = pool_over(tier, 8, fetch_batch_pages=1)
    try:
        tier.read_gate.clear()
        first = rp.prefetch(ks, "best_effort")
        assert tier.reads_started.acquire(timeout=30)  # the worker is inside batch_get
        second = rp.prefetch(ks, "best_effort")
        assert first.statuses == (S.FETCHING,) * 4 and second.statuses == (S.FETCHING,) * 4
    finally:
        tier.read_gate.set()
        rp.close()


def test_prefetch_without_host_room_says_no_space_and_a_gap_says_not_found():
    tier, ks = stored_tier(4)
    rp = pool_over(tier, 2)
    try:
        out = rp.prefetch(ks, "wait_complete")
        assert out.statuses == (S.FETCHED, S.FETCHED, S.NO_SPACE, S.NO_SPACE)
        assert rp.lookup(ks).tiers == (Tier.HOST, Tier.HOST, Tier.STORAGE, Tier.STORAGE)
    finally:
        rp.close()
    tier.delete(ks[1])  # a gap in the chain: what follows it is useless, and in storage
    rp = pool_over(tier, 8)
    try:
        out = rp.prefetch(ks + [key(99)], "wait_complete")
        assert out.statuses == (S.FETCHED, S.MISSING, S.NOT_FOUND, S.NOT_FOUND, S.MISSING)
    finally:
        rp.close()


def test_reload_into_pages_being_written_is_refused_before_host_changes():
    tier, _ = stored_tier(1)  # key 0: storage only
    rp = pool_over(tier, 1, write_policy="write_back")
    try:
        rp.offload([key(7)], [1])  # key 7 holds the only host page
        before = rp.lookup([key(0), key(7)]).tiers
        with rp.engine._writers.claim("device_pages", np.array([2])):  # an unfinished transfer into page 2
            with pytest.raises(ValueError, match=r"device_pages \[2\] are the destination of an unfinished"):
                rp.reload([key(0)], [2], layerwise=False)
        assert rp.lookup([key(0), key(7)]).tiers == before == (Tier.STORAGE, Tier.HOST)
        assert rp.stats().tiers[1].hits == 0  # nothing fetched, nothing counted
    finally:
        rp.close()
