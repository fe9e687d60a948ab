"""The layout interface: where each (page, layer, buffer) chunk of a flat pool lives.

A pool is one flat byte buffer of num_pages * page_bytes. A layout says where the
(page, layer, buffer) chunk lives: `page_size` rows of `buffer.row_bytes`, addressed as

    offset(page, layer, token) = base + page * page_stride + layer * layer_stride
                                 + token * token_stride

with a separate stride set per buffer (K, V, scales). Every copy path, CPU or Triton,
reads these strides; none probes tensor shapes. The layouts themselves are in layouts.py
(the pool's own) and engine_layouts.py (an engine's memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hicache.geometry import BufferSpec, KVGeometry


@dataclass(frozen=True)
class ChunkStrides:
    """Byte addressing of one buffer's (page, layer) chunks inside a flat pool."""

    base: int
    page_stride: int
    layer_stride: int
    token_stride: int
    row_bytes: int

    def offset(self, page: int, layer: int) -> int:
        return self.base + page * self.page_stride + layer * self.layer_stride

    @property
    def chunk_contiguous(self) -> bool:
        """Whether the page_size rows of a chunk are back to back."""
        return self.token_stride == self.row_bytes


class Layout:
    """Where each (page, layer, buffer) chunk of a flat pool lives."""

    name: str

    def __init__(self, geometry: KVGeometry, num_pages: int):
        geometry.pool_bytes(num_pages)  # validates num_pages
        self.geometry = geometry
        self.num_pages = num_pages
        self.strides: tuple[ChunkStrides, ...] = tuple(self._strides(i, b) for i, b in enumerate(geometry.buffers))

    @property
    def nbytes(self) -> int:
        return self.geometry.pool_bytes(self.num_pages)

    def _strides(self, index: int, buffer: BufferSpec) -> ChunkStrides:
        raise NotImplementedError

    def page_spans(self, pages: Sequence[int]) -> list[tuple[int, int]]:
        """The (offset, length) byte ranges that hold `pages` (every layer and buffer), sorted
        and merged: what a host pool commits or releases when its usable pages change."""
        pages_arr = np.asarray(sorted(set(pages)), dtype=np.int64)
        if pages_arr.size == 0:
            return []
        layers = np.arange(self.geometry.layer_num, dtype=np.int64)
        starts, ends = [], []
        for s in self.strides:
            chunk = (self.geometry.page_size - 1) * s.token_stride + s.row_bytes
            first = (s.base + pages_arr[:, None] * s.page_stride + layers[None, :] * s.layer_stride).ravel()
            starts.append(first)
            ends.append(first + chunk)
        start, end = np.concatenate(starts), np.concatenate(ends)
        order = np.argsort(start, kind="stable")
        start, end = start[order], np.maximum.accumulate(end[order])
        breaks = np.flatnonzero(start[1:] > end[:-1]) + 1  # a gap before these
        lo = start[np.concatenate(([0], breaks))]
        hi = end[np.concatenate((breaks - 1, [len(end) - 1]))]
        return [(int(a), int(b - a)) for a, b in zip(lo, hi, strict=True)]

    def regions(self) -> list[tuple[int, int]]:
        """Each buffer's (start, end): from its first chunk to the end of its last (the last
        page's last layer: strides are never negative)."""
        page, layer, token = self.num_pages - 1, self.geometry.layer_num - 1, self.geometry.page_size - 1
        return [(s.base, s.offset(page, layer) + token * s.token_stride + s.row_bytes) for s in self.strides]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_pages={self.num_pages})"
