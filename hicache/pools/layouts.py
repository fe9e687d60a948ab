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


class EngineLayout(Layout):
    """An engine's own pool layout, one region per buffer (K, V, or the MLA latent), each
    holding that buffer's rows of every page and layer in one of three orders (SGLang's
    host pools, with S = num_pages * page_size slots and L layers):

    - sglang_layer_first:        [L][S][row]
    - sglang_page_first:         [S][L][row]        (token-major)
    - sglang_page_first_direct:  [pages][L][P][row]

    Region b starts at bases[b]; by default the regions lie back to back (SGLang's one
    kv_buffer), and two memfds mapped one after the other give explicit bases. `extent`: the
    bytes of the memory (at least the regions' end; mappings round up to whole pages).
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
        if (
            len(bases) != len(sizes)
            or any(bases[i] + sizes[i] > bases[i + 1] for i in range(len(sizes) - 1))
            or any(b < 0 for b in bases)
        ):
            raise ValueError(
                f"engine layout {name!r}: regions of {sizes} bytes ({num_pages} pages) do not fit at offsets {bases}"
            )
        end = bases[-1] + sizes[-1]
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


_BY_NAME: dict[str, type[Layout]] = {c.name: c for c in (LayerFirst, PageFirst, PageFirstDirect)}


def make_layout(name: str, geometry: KVGeometry, num_pages: int) -> Layout:
    """The layout called `name` for a pool of num_pages pages. Raises ValueError."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown layout {name!r}; expected one of {list(LAYOUTS)}")
    return _BY_NAME[name](geometry, num_pages)


def canonical_page_layout(geometry: KVGeometry) -> Layout:
    """The layout of one flat page as stored and sent: page_first_direct with one page."""
    return PageFirstDirect(geometry, 1)
