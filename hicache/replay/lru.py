"""The exact prefix LRU a cache of a given size would match on a trace (the reference that
`hicache replay` compares the sidecar with).

A request hits its longest cached prefix of blocks; then every one of its blocks is
inserted or touched, in order, and the least recently used blocks beyond the capacity are
dropped. Hit tokens: Request.hit_tokens of that prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hicache.replay.trace import Request


class PrefixLRU:
    """`capacity` blocks (None: unbounded)."""

    def __init__(self, capacity: int | None):
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 blocks or None, got {capacity!r}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def request(self, req: Request) -> int:
        """Serve `req`: the blocks of its hit prefix."""
        hit = 0
        for b in req.blocks:
            if b not in self._blocks:
                break
            hit += 1
        for b in req.blocks:
            self._blocks[b] = None
            self._blocks.move_to_end(b)
        if self.capacity is not None:
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        return hit


def hit_rate(requests: Sequence[Request], capacity: int | None, nodes: int = 1) -> float:
    """Hit tokens over input tokens of an LRU of `capacity` blocks per node, request i
    served by node i mod `nodes`."""
    return shares_hit_rate([requests[i::nodes] for i in range(nodes)], capacity)


def shares_hit_rate(shares: Sequence[Sequence[Request]], capacity: int | None) -> float:
    """Hit tokens over input tokens of one LRU of `capacity` blocks per share of the requests
    (each share served in its order)."""
    hits = total = 0
    for share in shares:
        cache = PrefixLRU(capacity)
        hits += sum(r.hit_tokens(cache.request(r)) for r in share)
        total += sum(r.input_tokens for r in share)
    return hits / total if total else 0.0


def sweep(requests: Sequence[Request], capacities_tokens: Sequence[int], nodes: int = 1) -> list[tuple[int, float]]:
    """(capacity in tokens, hit rate) of a per-node LRU of each capacity."""
    block = requests[0].block_tokens if requests else 1
    return [(c, hit_rate(requests, c // block, nodes)) for c in capacities_tokens]
