"""A registered pool's counters and the PoolStats answer built from them and its cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.api import PoolStats, Tier, TierStats
from hicache.cache.tiering import HierarchicalCache
from hicache.sidecar.registration import PoolIdentity


@dataclass
class Counters:
    """Cumulative per-pool counters (guarded by the pool's lock)."""

    offload_bytes: int = 0
    offload_s: float = 0.0
    reload_bytes: int = 0
    reload_s: float = 0.0
    stored: int = 0
    deduplicated: int = 0
    no_space: int = 0

    @staticmethod
    def gbps(nbytes: int, seconds: float) -> float:
        return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def pool_stats(
    identity: PoolIdentity,
    cache: HierarchicalCache,
    cs: dict[str, Any],
    c: Counters,
    *,
    device_pages: int,
    in_flight: int,
    copy_backend: str,
    copy_path: str = "sidecar",
    cache_id: str = "",
    cache_members: int = 1,
) -> PoolStats:
    """`cs`: cache.stats(); `c`: the pool's counters (read under its lock)."""
    st = cs["storage"]
    tiers = (
        TierStats(
            Tier.HOST,
            cs["host_used_pages"],
            cs["host_bytes"],
            cs["host_hits"],
            cs["host_misses"],
            cs["host_pages"] * cache.geometry.page_bytes,
        ),
        TierStats(
            Tier.STORAGE,
            st["pages"] or 0,
            st["bytes"] or 0,
            cs["storage_hits"],
            cs["storage_misses"],
            st.get("capacity_bytes") or 0,
        ),
    )
    return PoolStats(
        identity.pool_id,
        identity.group,
        identity.namespace,
        identity.model_id,
        device_pages,
        cs["host_pages"],
        cs["host_used_pages"],
        cache.pinned_pages(),
        cache.geometry.page_bytes,
        tiers,
        c.offload_bytes,
        c.gbps(c.offload_bytes, c.offload_s),
        c.reload_bytes,
        c.gbps(c.reload_bytes, c.reload_s),
        in_flight,
        cache.storage.backend,
        bool(cs["storage_healthy"]),
        cs["write_queue_depth"],
        copy_backend,
        tuple(st.get("nodes_down") or ()),
        cache.write_policy,
        copy_path,
        cache_id,
        cache_members,
        c.stored,
        c.deduplicated,
        c.no_space,
        cs["writes_done"],
        cs["writes_dropped"],
        cs["write_failures"],
    )
