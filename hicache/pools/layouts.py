"""Declared memory layouts of a flat pool buffer.

A pool is one flat byte buffer of num_pages * page_bytes. A layout says where the
(page, layer, buffer) chunk lives: `page_size` rows of `buffer.row_bytes`, addressed as

    offset(page, layer, token) = base + page * page_stride + layer * layer_stride
                                 + token * token_stride

with a separate stride set per buffer (K, V, scales). Every copy path, CPU or Triton,
reads these strides; none probes tensor shapes.

- layer_first:        [layer][buffer][slot][row]   (the device pool's own layout)
- page_first:         [page][token][layer][buffer row]   (a page is contiguous, token-major)
- page_first_direct:  [page][layer][buffer][token][row]  (a page is contiguous, and each
                      (page, layer) chunk too; this is also the canonical flat page format)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hicache.geometry import BufferSpec, KVGeometry

LayoutName = Literal["layer_first", "page_first", "page_first_direct"]
LAYOUTS: tuple[str, ...] = ("layer_first", "page_first", "page_first_direct")


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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_pages={self.num_pages})"


class LayerFirst(Layout):
    name = "layer_first"

    def _strides(self, index: int, buffer: BufferSpec) -> ChunkStrides:
        g = self.geometry
        chunk = g.chunk_bytes(buffer)
        return ChunkStrides(
            base=g.chunk_offset(index) * self.num_pages,
            page_stride=chunk,
            layer_stride=g.page_bytes_for(1) * self.num_pages,
            token_stride=buffer.row_bytes,
            row_bytes=buffer.row_bytes,
        )


class PageFirst(Layout):
    name = "page_first"

    def _strides(self, index: int, buffer: BufferSpec) -> ChunkStrides:
        g = self.geometry
        return ChunkStrides(
            base=g.row_offset(index),
            page_stride=g.page_bytes,
            layer_stride=g.layer_row_bytes,
            token_stride=g.token_bytes,
            row_bytes=buffer.row_bytes,
        )


class PageFirstDirect(Layout):
    name = "page_first_direct"

    def _strides(self, index: int, buffer: BufferSpec) -> ChunkStrides:
        g = self.geometry
        return ChunkStrides(
            base=g.chunk_offset(index),
            page_stride=g.page_bytes,
            layer_stride=g.page_bytes_for(1),
            token_stride=buffer.row_bytes,
            row_bytes=buffer.row_bytes,
        )


_BY_NAME: dict[str, type[Layout]] = {c.name: c for c in (LayerFirst, PageFirst, PageFirstDirect)}


def make_layout(name: str, geometry: KVGeometry, num_pages: int) -> Layout:
    """The layout called `name` for a pool of num_pages pages. Raises ValueError."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown layout {name!r}; expected one of {list(LAYOUTS)}")
    return _BY_NAME[name](geometry, num_pages)


def canonical_page_layout(geometry: KVGeometry) -> Layout:
    """The layout of one flat page as stored and sent: page_first_direct with one page."""
    return PageFirstDirect(geometry, 1)
