"""Copy descriptors: what the compiled copy path (native.py) copies, as int64 rows.

A descriptor is (dst, src, rows, row_bytes, dst_stride, src_stride): one (page, layer,
buffer) chunk, or a merged run of them, with both offsets computed from the two layouts'
strides. A small transfer's descriptors come from a cached page template (page 0 to page
0, shifted per page); a large one's are built in C (native.descriptors, native.layered).
CopyBatch and LayeredBatch carry them to the copy calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

import numpy as np

from hicache.transfer.plan import TransferPlan

if TYPE_CHECKING:
    from hicache.pools.flat import FlatPool
    from hicache.pools.layouts import Layout

DST, SRC, ROWS, ROW_BYTES, DST_STRIDE, SRC_STRIDE = range(6)


@dataclass(frozen=True)
class CopyBatch:
    """Copy descriptors (n, 6) int64, copied row-interleaved in groups of `group` (see _native.c)."""

    descs: np.ndarray
    group: int = 1
    moves: int | None = None  # the bytes it copies, when its builder knows them from the plan

    @cached_property  # read by the engine (threads or not) and by batch_call (streaming or not)
    def nbytes(self) -> int:
        return self.moves if self.moves is not None else _bytes_of(self.descs)


def _bytes_of(descs: np.ndarray) -> int:
    return int((descs[:, ROWS] * descs[:, ROW_BYTES]).sum()) if len(descs) else 0


def chunk_parts(src: FlatPool, dst: FlatPool, plan: TransferPlan, layer_arr: np.ndarray) -> list[np.ndarray]:
    """Per buffer, one descriptor per (page, layer) chunk, page-major: (pages x layers, 6)."""
    return _chunk_parts(src.layout, dst.layout, src.geometry.page_size, plan, layer_arr)


def _chunk_parts(
    src: Layout, dst: Layout, page_size: int, plan: TransferPlan, layer_arr: np.ndarray
) -> list[np.ndarray]:
    parts = []
    for s, d in zip(src.strides, dst.strides, strict=True):
        src_off = s.base + plan.src_pages[:, None] * s.page_stride + layer_arr[None, :] * s.layer_stride
        dst_off = d.base + plan.dst_pages[:, None] * d.page_stride + layer_arr[None, :] * d.layer_stride
        if s.chunk_contiguous and d.chunk_contiguous:  # the chunk is one block on both sides
            shape = (1, page_size * s.row_bytes, page_size * s.row_bytes, page_size * s.row_bytes)
        else:
            shape = (page_size, s.row_bytes, d.token_stride, s.token_stride)
        part = np.empty((src_off.size, 6), dtype=np.int64)
        part[:, DST] = dst_off.ravel()
        part[:, SRC] = src_off.ravel()
        part[:, ROWS:] = shape
        parts.append(part)
    return parts


@dataclass(frozen=True)
class PageTemplate:
    """The descriptors of copying page 0 to page 0 for a set of layers (buffer by buffer,
    layer by layer), and per descriptor the page stride of each side: page
    s -> page d is descs + (d * dst_stride, s * src_stride) in the DST and SRC columns."""

    descs: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray


@lru_cache(maxsize=64)
def page_template(src: Layout, dst: Layout, page_size: int, layers: tuple[int, ...]) -> PageTemplate:
    """The template of a (src layout, dst layout, layers), made once: a small transfer's
    descriptors are then three numpy operations, not a dozen per buffer."""
    zero = np.zeros(1, dtype=np.int64)
    plan = TransferPlan(zero, zero, layers, ())
    parts = _chunk_parts(src, dst, page_size, plan, np.asarray(layers, dtype=np.int64))
    count = len(layers)
    src_stride = np.repeat([s.page_stride for s in src.strides], count).astype(np.int64)
    dst_stride = np.repeat([d.page_stride for d in dst.strides], count).astype(np.int64)
    descs = np.concatenate(parts)
    for shared in (descs, src_stride, dst_stride):  # cached: every caller reads the same arrays
        shared.flags.writeable = False
    return PageTemplate(descs, src_stride, dst_stride)


@dataclass(frozen=True)
class LayeredBatch:
    """A whole transfer's descriptors, layer by layer: layer i (of the plan's order) is
    descs[ends[i-1]:ends[i]], copied row-interleaved in groups of `group`."""

    descs: np.ndarray
    ends: np.ndarray
    group: int = 1
    moves: int | None = None  # as CopyBatch's

    @cached_property
    def nbytes(self) -> int:
        return self.moves if self.moves is not None else _bytes_of(self.descs)


def small_descriptors(src: FlatPool, dst: FlatPool, plan: TransferPlan, layers: Sequence[int]) -> np.ndarray:
    """The descriptors of a small transfer, page by page (unsorted), from the cached template."""
    t = page_template(src.layout, dst.layout, src.geometry.page_size, tuple(layers))
    n = plan.num_pages
    if n == 1:
        descs = t.descs.copy()
        descs[:, SRC] += int(plan.src_pages[0]) * t.src_stride
        descs[:, DST] += int(plan.dst_pages[0]) * t.dst_stride
        return descs
    descs = np.tile(t.descs, (n, 1))
    descs[:, SRC] += (np.asarray(plan.src_pages, dtype=np.int64)[:, None] * t.src_stride).ravel()
    descs[:, DST] += (np.asarray(plan.dst_pages, dtype=np.int64)[:, None] * t.dst_stride).ravel()
    return descs


@lru_cache(maxsize=64)
def _strides(layout: Layout) -> np.ndarray:
    """(base, page_stride, layer_stride, token_stride, row_bytes) of each buffer's chunks."""
    rows = [(s.base, s.page_stride, s.layer_stride, s.token_stride, s.row_bytes) for s in layout.strides]
    out = np.array(rows, dtype=np.int64).reshape(-1, 5)
    out.flags.writeable = False
    return out


def _descs(data: bytearray) -> np.ndarray:
    """An (n, 6) int64 view of descriptors the C code returned (no copy)."""
    return np.frombuffer(data, dtype=np.int64).reshape(-1, 6)
