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
- EngineLayout:       an engine's own layout (SGLang's host pools), for copies straight
                      from and to the engine's memory
- BlockLayout:        an engine that keeps each (layer, page) as one block of bytes at
                      offset + layer * layer_stride + page * block_stride (vLLM's KV cache)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

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


class EngineLayout(Layout):
    """An engine's own pool layout, one region per buffer (K, V, or the MLA latent), each
    holding that buffer's rows of every page and layer in one of three orders (SGLang's
    host pools, with S = num_pages * page_size slots and L layers):

    - sglang_layer_first:        [L][S][row]
    - sglang_page_first:         [S][L][row]        (token-major)
    - sglang_page_first_direct:  [pages][L][P][row]

    Region b starts at bases[b]; by default the regions lie back to back (SGLang's one
    kv_buffer). Two memfds mapped one after the other give explicit bases, and so do an
    engine's separate K and V allocations seen in its own process (memory.span_buffer), where
    V may lie below K. `extent`: the bytes of the memory (at least the regions' end; mappings
    round up to whole pages).
    Raises ValueError for an unknown order, scale buffers, or bases that overlap.
    """

    ORDERS = ("sglang_layer_first", "sglang_page_first", "sglang_page_first_direct")

    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        name: str,
        bases: tuple[int, ...] | None = None,
        extent: int | None = None,
    ):
        if name not in self.ORDERS:
            raise ValueError(f"unknown engine layout {name!r}; expected one of {list(self.ORDERS)}")
        if any(b.name.endswith("_scale") for b in geometry.buffers):
            raise ValueError(f"engine layout {name!r} holds no scale buffers (fp4); got {geometry.dtype}")
        self.name = name
        sizes = [geometry.layer_num * num_pages * geometry.page_size * b.row_bytes for b in geometry.buffers]
        if bases is None:
            bases = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        order = sorted(range(len(bases)), key=lambda i: bases[i])  # regions in address order
        if (
            len(bases) != len(sizes)
            or any(bases[a] + sizes[a] > bases[b] for a, b in zip(order, order[1:], strict=False))
            or any(b < 0 for b in bases)
        ):
            raise ValueError(
                f"engine layout {name!r}: regions of {sizes} bytes ({num_pages} pages) do not fit at offsets {bases}"
            )
        end = max(b + n for b, n in zip(bases, sizes, strict=True))
        if extent is not None and extent < end:
            raise ValueError(f"engine layout {name!r} needs {end} bytes, the memory holds {extent}")
        self.bases, self.sizes, self.extent = bases, sizes, end if extent is None else extent
        super().__init__(geometry, num_pages)

    @property
    def nbytes(self) -> int:
        return self.extent

    def _strides(self, index: int, buffer: BufferSpec) -> ChunkStrides:
        g, row = self.geometry, buffer.row_bytes
        slots, base = self.num_pages * g.page_size, self.bases[index]
        if self.name == "sglang_layer_first":
            return ChunkStrides(base, g.page_size * row, slots * row, row, row)
        if self.name == "sglang_page_first":
            return ChunkStrides(base, g.page_size * g.layer_num * row, row, g.layer_num * row, row)
        return ChunkStrides(base, g.layer_num * g.page_size * row, g.page_size * row, row, row)


class BlockLayout(Layout):
    """An engine's KV memory where the (layer, page) chunk of every buffer lies in one block:
    the page of layer l starts at offset + l * layer_stride + page * block_stride, and holds
    the page_size rows of each buffer back to back (K, then V; or the MLA latent). This is
    vLLM's KVCacheTensor placement: the sidecar copies each block as bytes, never reading
    inside it, so vLLM's order within a page (its [H, N, C] cells) is kept as is.

    Name: "vllm_blocks:<offset>:<layer_stride>:<block_stride>". `extent`: the bytes of the
    memory. The strides must nest: the smaller one at least a block, the larger one past a
    whole run of the smaller. Raises ValueError for a malformed name, blocks that overlap,
    or memory too small.
    """

    PREFIX = "vllm_blocks"

    def __init__(self, geometry: KVGeometry, num_pages: int, name: str, extent: int):
        self.offset, self.layer_stride, self.block_stride = parse_block_layout(name)
        block = geometry.page_bytes_for(1)
        span = block  # bytes covered by one run of the smaller stride's blocks
        for stride, count in sorted(((self.layer_stride, geometry.layer_num), (self.block_stride, num_pages))):
            if count > 1 and stride < span:
                raise ValueError(
                    f"device layout {name!r}: layer stride {self.layer_stride} and block stride "
                    f"{self.block_stride} would overlap ({geometry.layer_num} layers, {num_pages} pages "
                    f"of {block}-byte blocks)"
                )
            span += (count - 1) * stride
        end = self.offset + (geometry.layer_num - 1) * self.layer_stride + (num_pages - 1) * self.block_stride + block
        if extent < end:
            raise ValueError(
                f"device layout {name!r} needs {end} bytes for {num_pages} pages, the memory holds {extent}"
            )
        self.name, self.extent = name, extent
        super().__init__(geometry, num_pages)

    @property
    def nbytes(self) -> int:
        return self.extent

    def _strides(self, index: int, buffer: BufferSpec) -> ChunkStrides:
        g = self.geometry
        base = self.offset + sum(g.chunk_bytes(b) for b in g.buffers[:index])
        return ChunkStrides(base, self.block_stride, self.layer_stride, buffer.row_bytes, buffer.row_bytes)


def block_layout_name(offset: int, layer_stride: int, block_stride: int) -> str:
    """The BlockLayout name for these byte offsets."""
    return f"{BlockLayout.PREFIX}:{offset}:{layer_stride}:{block_stride}"


def parse_block_layout(name: str) -> tuple[int, int, int]:
    """(offset, layer_stride, block_stride) of a BlockLayout name. Raises ValueError."""
    parts = name.split(":")
    if len(parts) != 4 or parts[0] != BlockLayout.PREFIX or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"device layout {name!r} is not {BlockLayout.PREFIX}:<offset>:<layer_stride>:<block_stride>")
    return int(parts[1]), int(parts[2]), int(parts[3])


def check_engine_layout(name: str) -> None:
    """Raises ValueError unless `name` is an engine layout the sidecar can map."""
    if name.startswith(BlockLayout.PREFIX + ":"):
        parse_block_layout(name)
    elif name not in EngineLayout.ORDERS:
        raise ValueError(
            f"unknown device layout {name!r}; expected '', one of {list(EngineLayout.ORDERS)} "
            f"or {BlockLayout.PREFIX}:<offset>:<layer_stride>:<block_stride>"
        )


def check_segments(layout: Layout, segments: Sequence[tuple[str, int, int]]) -> None:
    """Raises ValueError, naming the segment, its size and the bytes needed, unless each
    buffer's region of `layout` lies within the segment it starts in. `segments`: (name,
    offset, size) of the files mapped one after the other, the first at offset 0, each size
    its file's (the rest of its last mmap page is past the file's end)."""
    for start, end in layout.regions():
        name, offset, size = [seg for seg in segments if seg[1] <= start][-1]
        if end - offset > size:
            raise ValueError(
                f"{name} holds {size} bytes, device layout {layout.name!r} of {layout.num_pages} pages "
                f"needs {end - offset} of it"
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


def engine_layout(geometry: KVGeometry, pages: int, layout: str, bases: tuple[int, ...] | None, extent: int) -> Layout:
    """An engine's own layout `layout` (an EngineLayout or BlockLayout name) of `pages` pages
    over memory of `extent` bytes whose buffers start at `bases` (None: back to back).
    Raises ValueError for memory too small."""
    if layout.startswith(BlockLayout.PREFIX):
        if bases is not None:
            raise ValueError(f"device layout {layout!r} addresses one segment, got {len(bases)}")
        return BlockLayout(geometry, pages, layout, extent=extent)
    return EngineLayout(geometry, pages, layout, bases, extent=extent)
