"""The common part of the device and host pools: a flat byte buffer plus a layout."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch

from hicache.geometry import KVGeometry
from hicache.memory import MemoryHandle, SharedBuffer, local_buffer, wrap_tensor
from hicache.pools.layouts import Layout, canonical_page_layout
from hicache.validate import is_int

MAX_PAGE_PIECES = 256  # a page in more pieces than this is copied by write_page instead


class FlatPool:
    """num_pages pages of `geometry` in one flat uint8 buffer, addressed by `layout`."""

    def __init__(self, geometry: KVGeometry, layout: Layout, memory: SharedBuffer):
        if memory.nbytes != layout.nbytes:
            raise ValueError(
                f"memory holds {memory.nbytes} bytes but {layout!r} of this geometry needs {layout.nbytes}"
            )
        self.geometry = geometry
        self.layout = layout
        self.memory = memory

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    @property
    def nbytes(self) -> int:
        """The layout's bytes: num_pages * geometry.page_bytes, except for an engine's own
        layout with gaps between its regions (EngineLayout)."""
        return self.memory.nbytes

    @property
    def flat(self) -> torch.Tensor:
        """The whole pool as a flat uint8 tensor."""
        return self.memory.tensor

    @property
    def handle(self) -> MemoryHandle:
        return self.memory.handle

    def chunks(self, buffer: int, page: int, layer: int, pages: int = 1, layers: int = 1) -> torch.Tensor:
        """A uint8 view of `pages` consecutive pages x `layers` consecutive layers of one buffer.

        Shape: [pages, layers, page_size, row_bytes]. Writes through to the pool.
        """
        s = self.layout.strides[buffer]
        flat = self.flat
        return torch.as_strided(
            flat,
            (pages, layers, self.geometry.page_size, s.row_bytes),
            (s.page_stride, s.layer_stride, s.token_stride, 1),
            flat.storage_offset() + s.offset(page, layer),  # as_strided counts from the storage's start
        )

    def read_page(self, page: int) -> torch.Tensor:
        """One page as a flat uint8 tensor of page_bytes, in the canonical page format
        (page_first_direct order), whatever this pool's layout. Raises ValueError."""
        self._check_page(page)
        out = FlatPool(self.geometry, canonical_page_layout(self.geometry), local_buffer(self.geometry.page_bytes))
        _copy_page(self, page, out, 0)
        return out.flat

    def write_page(self, page: int, data: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Write one canonical flat page (page_bytes) into `page`. Raises ValueError.
        A writable buffer (a tier's reused read buffer) is copied from where it is; a
        read-only one (bytes) is copied once first, as torch cannot wrap it."""
        self._check_page(page)
        if isinstance(data, torch.Tensor):
            src = data
        else:
            view = memoryview(data)
            if view.nbytes != self.geometry.page_bytes:
                raise ValueError(f"page data must be {self.geometry.page_bytes} uint8 bytes, got {view.nbytes} bytes")
            direct = not view.readonly and view.c_contiguous
            src = torch.frombuffer(view.cast("B") if direct else bytearray(view), dtype=torch.uint8)
        if src.dtype != torch.uint8 or src.dim() != 1 or src.numel() != self.geometry.page_bytes:
            raise ValueError(
                f"page data must be {self.geometry.page_bytes} uint8 bytes, got {src.numel()} "
                f"of {src.dtype}, shape {tuple(src.shape)}"
            )
        page_pool = FlatPool(self.geometry, canonical_page_layout(self.geometry), wrap_tensor(src.contiguous()))
        _copy_page(page_pool, 0, self, page)

    def page_pieces(self, page: int) -> list[memoryview] | None:
        """Writable views of `page`'s bytes in the canonical page order (read_page's), one
        per run of bytes contiguous in both orders: what a tier reads a stored page straight
        into (StorageTier.batch_read_into). None for a pool on a GPU, or one whose page
        would be more than MAX_PAGE_PIECES pieces (page_first's token rows): write_page
        copies into those instead. Raises ValueError for a page out of range."""
        self._check_page(page)
        if self.memory.closed:
            raise ValueError("the pool's memory is closed")
        template = self._piece_template
        if template is None or self.flat.is_cuda:
            return None
        starts, page_strides, sizes = template
        whole = self.flat.numpy().data
        return [whole[a : a + n] for a, n in zip((starts + page * page_strides).tolist(), sizes, strict=True)]

    @cached_property
    def _piece_template(self) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
        """Page 0's pieces (pool offsets, their page strides, sizes) in canonical order."""
        g = self.geometry
        canon = canonical_page_layout(g)
        rows = []  # (canonical offset, pool offset at page 0, page stride, bytes)
        for b, (c, s) in enumerate(zip(canon.strides, self.layout.strides, strict=True)):
            whole = s.chunk_contiguous
            count, size = (1, g.chunk_bytes(g.buffers[b])) if whole else (g.page_size, s.row_bytes)
            for layer in range(g.layer_num):
                for t in range(count):
                    rows.append(
                        (
                            c.offset(0, layer) + t * c.token_stride,
                            s.offset(0, layer) + t * s.token_stride,
                            s.page_stride,
                            size,
                        )
                    )
                if len(rows) > 4 * MAX_PAGE_PIECES:
                    return None
        rows.sort()
        pieces = [list(rows[0])]
        for canon_at, at, stride, size in rows[1:]:
            last = pieces[-1]
            if last[0] + last[3] == canon_at and last[1] + last[3] == at and last[2] == stride:
                last[3] += size
            else:
                pieces.append([canon_at, at, stride, size])
        assert pieces[0][0] == 0 and sum(p[3] for p in pieces) == g.page_bytes, "the rows do not tile the page"
        if len(pieces) > MAX_PAGE_PIECES:
            return None
        table = np.asarray(pieces, dtype=np.int64)
        return table[:, 1].copy(), table[:, 2].copy(), table[:, 3].tolist()

    def _check_page(self, page: int) -> None:
        if not is_int(page) or not 0 <= page < self.num_pages:
            raise ValueError(f"page {page!r} out of range [0, {self.num_pages})")

    def check_integrity(self) -> None:
        """Assert that the memory, the layout and the geometry agree."""
        g = self.geometry
        assert self.nbytes == self.layout.nbytes >= self.num_pages * g.page_bytes, (self.nbytes, self.layout.nbytes)
        assert self.flat.numel() == self.nbytes and self.flat.dtype == torch.uint8
        assert not self.memory.closed, "pool memory is closed"
        spans = []
        for i, s in enumerate(self.layout.strides):
            last = s.offset(self.num_pages - 1, g.layer_num - 1) + (g.page_size - 1) * s.token_stride
            assert last + s.row_bytes <= self.nbytes, f"buffer {g.buffers[i].name} runs past the pool end"
            spans.append(s.row_bytes)
        assert sum(spans) == g.layer_row_bytes

    def copy_pages_from(self, src: FlatPool, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        """Copy src's page src_pages[i] into this pool's page dst_pages[i], every layer and
        buffer. Raises ValueError for another geometry, unequal lists or a page out of range."""
        if src.geometry != self.geometry:
            raise ValueError(f"pools of different geometries; fields differ: {self.geometry.diff(src.geometry)}")
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"got {len(src_pages)} source pages but {len(dst_pages)} destination pages")
        for s_page, d_page in zip(src_pages, dst_pages, strict=True):
            src._check_page(s_page)
            self._check_page(d_page)
            _copy_page(src, s_page, self, d_page)

    def close(self) -> None:
        """Release the pool's memory. The pool is unusable afterwards."""
        self.memory.close()


def _copy_page(src: FlatPool, src_page: int, dst: FlatPool, dst_page: int) -> None:
    layers = src.geometry.layer_num
    for b in range(len(src.geometry.buffers)):
        dst.chunks(b, dst_page, 0, 1, layers).copy_(src.chunks(b, src_page, 0, 1, layers))
