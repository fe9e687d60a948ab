"""One host-memory budget per sidecar (--hicache-size GB), split among its pools.

The rule, recomputed at every registration and release: with n pools live, each pool i of
device-pool bytes w_i (its registration: device pages x page bytes) first gets a floor of
min(w_i, budget / (4 n)); the rest of the budget is split in proportion to w_i. A pool gets
as many whole pages as its share holds, and never more than its segment, which is sized by
its share when it registered: pools registered later are sized for the pools live then;
when pools leave, the others grow back up to the size they were made with. The shares
never add up to more than the budget. A pool whose share is less than one page is refused.
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


def split(budget_bytes: int, claims: Sequence[Claim]) -> list[int]:
    """Host pages for each claim, in order (see the module docstring); 0 for a claim whose
    share holds no whole page. Raises ValueError for a budget < 1 or a bad claim."""
    if budget_bytes < 1:
        raise ValueError(f"the host budget must be >= 1 byte, got {budget_bytes}")
    if any(c.device_bytes < 1 or c.page_bytes < 1 for c in claims):
        raise ValueError(f"every claim needs device_bytes and page_bytes >= 1, got {list(claims)}")
    if not claims:
        return []
    n = len(claims)
    floors = [min(c.device_bytes, budget_bytes // (4 * n)) for c in claims]
    rest = budget_bytes - sum(floors)
    weights = sum(c.device_bytes for c in claims)
    out = []
    for c, floor in zip(claims, floors, strict=True):
        share = floor + rest * c.device_bytes // weights
        pages = share // c.page_bytes
        out.append(pages if c.max_pages is None else min(pages, c.max_pages))
    return out
