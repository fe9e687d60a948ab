"""One host-memory budget per sidecar (--hicache-size GB), split among its pools.

The rule, recomputed at every registration and release, is applied twice: first the budget
is split among the namespaces with a pool live, then each namespace's part among its host
caches. At each level, with n parties live, each first gets a floor of budget / (2 n),
whatever its weight; the other half is split in proportion to the weights (a cache's weight
is its device pool's bytes, a namespace's the sum of its caches'). An engine-copy pool's
device size cannot be checked, so a claim of any size moves only its own namespace's part
past the floor: another namespace keeps at least budget / (2 x namespaces), and another
cache of the same namespace at least half of its namespace's part / its caches.

A pool gets as many whole pages as its share holds, and never more than its segment, which
is sized by its share when it registered: pools registered later are sized for the pools
live then; when pools leave, the others grow back up to the size they were made with. The
shares never add up to more than the budget. A pool whose share is less than one page is
refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    """What one pool asks of the budget."""

    device_bytes: int  # its device pool: the weight of its share
    page_bytes: int
    max_pages: int | None = None  # its segment's pages (None: not made yet)
    namespace: str = ""  # the tenant it counts against


def split(budget_bytes: int, claims: Sequence[Claim]) -> list[int]:
    """Host pages for each claim, in order (see the module docstring); 0 for a claim whose
    share holds no whole page. Raises ValueError for a budget < 1 or a bad claim."""
    if budget_bytes < 1:
        raise ValueError(f"the host budget must be >= 1 byte, got {budget_bytes}")
    if any(c.device_bytes < 1 or c.page_bytes < 1 for c in claims):
        raise ValueError(f"every claim needs device_bytes and page_bytes >= 1, got {list(claims)}")
    tenants = list(dict.fromkeys(c.namespace for c in claims))
    weights = [sum(c.device_bytes for c in claims if c.namespace == t) for t in tenants]
    parts = dict(zip(tenants, _shares(budget_bytes, weights), strict=True))
    out = [0] * len(claims)
    for t in tenants:
        mine = [i for i, c in enumerate(claims) if c.namespace == t]
        for i, share in zip(mine, _shares(parts[t], [claims[i].device_bytes for i in mine]), strict=True):
            c = claims[i]
            pages = share // c.page_bytes
            out[i] = pages if c.max_pages is None else min(pages, c.max_pages)
    return out


def _shares(total: int, weights: Sequence[int]) -> list[int]:
    """`total` split over len(weights) parties: a floor of total // (2n) each, then the rest
    in proportion to the weights. The shares add up to at most `total`."""
    n = len(weights)
    if n == 0:
        return []
    floor = total // (2 * n)
    rest = total - n * floor
    weight = sum(weights)
    return [floor + rest * w // weight for w in weights]
