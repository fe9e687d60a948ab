"""`hicache stats`: the stats of every pool on a running sidecar, as a table or JSON."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from hicache.api import PoolStats
from hicache.client import ClientTls, HiCacheClient, HiCacheRpcError


def stats_to_dict(s: PoolStats) -> dict[str, Any]:
    """A PoolStats as plain JSON-ready values (tiers by name)."""
    d = asdict(s)
    d["tiers"] = {t.tier.value: {k: v for k, v in asdict(t).items() if k != "tier"} for t in s.tiers}
    return d


def format_table(pools: list[PoolStats]) -> str:  # f-strings, not rich: the server image stays dependency-light
    """One row per pool: occupancy, bytes moved, GB/s and per-tier hits/misses."""
    if not pools:
        return "no pools registered"
    head = (
        f"{'pool':22} {'group':5} {'namespace':14} {'host used':>11} {'pinned':>6} "
        f"{'offload GB':>10} {'GB/s':>6} {'reload GB':>9} {'GB/s':>6} {'copies':>6} {'in flight':>9}  "
        "tiers (pages hits/misses)"
    )
    lines = [head, "-" * len(head)]
    for s in pools:
        tiers = "  ".join(
            f"{t.tier.value} {t.pages} {t.hits}/{t.misses}"
            + (f" (cap {t.capacity_bytes / 1e9:.2f} GB)" if t.capacity_bytes else "")
            for t in s.tiers
        )
        if s.storage_nodes_down:
            tiers += f"  storage nodes down: {', '.join(s.storage_nodes_down)}"
        lines.append(
            f"{s.pool_id:22} {s.group:5} {s.namespace[:14]:14} {f'{s.used_pages}/{s.host_pages}':>11} "
            f"{s.pinned_pages:>6} {s.offload_bytes / 1e9:>10.3f} {s.offload_gbps:>6.2f} "
            f"{s.reload_bytes / 1e9:>9.3f} {s.reload_gbps:>6.2f} {s.copy_backend:>6} {s.ops_in_flight:>9}  {tiers}"
        )
    return "\n".join(lines)


def print_stats(
    target: str,
    *,
    token: str | None = None,
    admin_token: str | None = None,
    as_json: bool = False,
    timeout: float = 5.0,
    tls: ClientTls | None = None,
) -> int:
    """Query the sidecar at `target` and print the stats of all its pools (they need its
    --admin-token). Returns 0, or 1 if the call failed."""
    with HiCacheClient(target, token=token, timeout=timeout, retries=0, admin_token=admin_token, tls=tls) as client:
        try:
            pools = client.stats(all_pools=True)
        except HiCacheRpcError as exc:
            print(f"hicache stats: {target}: {exc}", file=sys.stderr)
            return 1
    if as_json:
        print(json.dumps({"target": target, "pools": [stats_to_dict(s) for s in pools]}, indent=2))
    else:
        print(format_table(pools))
    return 0
