"""Engine layouts: an engine's own KV memory, addressed in place, so that the sidecar
copies straight from and to it.

- EngineLayout:  SGLang's host pools, one region per buffer in one of three orders
                 ("sglang_<order>")
- BlockLayout:   each (layer, page) as one block of bytes at offset + layer * layer_stride
                 + page * block_stride (vLLM's KV cache, "vllm_blocks:...")

Also the checks of an engine layout's name and of the files its memory is mapped from.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.geometry import BufferSpec, KVGeometry
from hicache.pools.layout_base import ChunkStrides, Layout


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


def engine_layout(geometry: KVGeometry, pages: int, layout: str, bases: tuple[int, ...] | None, extent: int) -> Layout:
    """An engine's own layout `layout` (an EngineLayout or BlockLayout name) of `pages` pages
    over memory of `extent` bytes whose buffers start at `bases` (None: back to back).
    Raises ValueError for memory too small."""
    if layout.startswith(BlockLayout.PREFIX):
        if bases is not None:
            raise ValueError(f"device layout {layout!r} addresses one segment, got {len(bases)}")
        return BlockLayout(geometry, pages, layout, extent=extent)
    return EngineLayout(geometry, pages, layout, bases, extent=extent)
