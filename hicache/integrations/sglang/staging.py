"""A staging pool: hicache pages in the adapter's process, registered with the sidecar once,
that SGLang's host pages are copied through (SGLang host -> staging -> sidecar on set, back
on get). The sidecar maps it like any engine's device pool (POSIX shared memory)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from hicache.integrations.sglang.pool_views import LayerViews
from hicache.pools import DeviceKVPool


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as raw bytes (fp8 is uint8 in hicache, float8 in SGLang)."""
    return t.view(torch.uint8)


class StagingArea:
    """`pool` pages [first, first + size) for one direction of copies, under one lock (SGLang
    calls from its prefetch and backup threads at once)."""

    def __init__(self, pool: DeviceKVPool, first: int, size: int):
        self.pool, self.first, self.size = pool, first, size
        self.lock = threading.Lock()
        g = pool.geometry
        self._views = [
            tuple(_bytes(b.unflatten(0, (pool.num_pages, g.page_size))) for b in pool.layer_buffers(layer))
            for layer in range(g.layer_num)
        ]

    def pages(self, n: int) -> list[int]:
        assert 0 <= n <= self.size
        return list(range(self.first, self.first + n))

    def gather(self, src: LayerViews, src_pages: Sequence[int]) -> None:
        """Copy pages src_pages of `src` (SGLang page views) into this area's first pages."""
        idx = torch.as_tensor(list(src_pages), dtype=torch.long)
        n = len(idx)
        for layer, sides in enumerate(src):
            for side, mine in zip(sides, self._views[layer], strict=False):
                if side is not None:
                    torch.index_select(_bytes(side), 0, idx, out=mine[self.first : self.first + n])

    def scatter(self, dst: LayerViews, dst_pages: Sequence[int]) -> None:
        """Copy this area's first len(dst_pages) pages into pages dst_pages of `dst`."""
        idx = torch.as_tensor(list(dst_pages), dtype=torch.long)
        n = len(idx)
        for layer, sides in enumerate(dst):
            for side, mine in zip(sides, self._views[layer], strict=False):
                if side is not None:
                    _bytes(side).index_copy_(0, idx, mine[self.first : self.first + n])
