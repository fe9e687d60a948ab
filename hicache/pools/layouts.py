"""Declared memory layouts of a flat pool buffer (the addressing is in layout_base.py).

- layer_first:        [layer][buffer][slot][row]   (the device pool's own layout)
- page_first:         [page][token][layer][buffer row]   (a page is contiguous, token-major)
- page_first_direct:  [page][layer][buffer][token][row]  (a page is contiguous, and each
                      (page, layer) chunk too; this is also the canonical flat page format)
- EngineLayout:       an engine's own layout (SGLang's host pools), for copies straight
                      from and to the engine's memory (engine_layouts.py)
- BlockLayout:        an engine that keeps each (layer, page) as one block of bytes at
                      offset + layer * layer_stride + page * block_stride (vLLM's KV cache;
                      engine_layouts.py)
"""

from __future__ import annotations

from typing import Literal

from hicache.geometry import BufferSpec, KVGeometry
from hicache.pools.engine_layouts import (  # noqa: F401 (callers import the engine layouts from here)
    BlockLayout,
    EngineLayout,
    block_layout_name,
    check_engine_layout,
    check_segments,
    engine_layout,
    parse_block_layout,
)
from hicache.pools.layout_base import ChunkStrides, Layout

LayoutName = Literal["layer_first", "page_first", "page_first_direct"]
LAYOUTS: tuple[str, ...] = ("layer_first", "page_first", "page_first_direct")


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
