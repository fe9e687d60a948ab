"""The compiled CPU copy path: a transfer as one array of row-block descriptors.

Every (page, layer, buffer) chunk of a transfer becomes a descriptor (dst, src, rows,
row_bytes, dst_stride, src_stride) computed from the two layouts' strides with numpy, in
destination order; chunks adjacent on both sides (page runs) merge into copies of about
MERGE_CAP bytes. The C extension (_native.c) copies a whole descriptor array per call with
the GIL released, so the Python cost is per transfer, not per page, and the copy threads
run in parallel. Transfers of STREAM_MIN_BYTES or more use non-temporal stores.

Without the compiled extension (no C compiler at install time) available() is False and
the engine uses torch copies instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from types import ModuleType

import numpy as np

from hicache.pools.flat import FlatPool
from hicache.transfer.plan import TransferPlan

_native: ModuleType | None
try:
    from hicache.transfer import _native
except ImportError:  # built by setup.py where a C compiler exists
    _native = None

MERGE_CAP = 1 << 20  # merged copies end once past this (so at most MERGE_CAP + one chunk): even shares
STREAM_MIN_BYTES = 16 << 20  # about half the L3 of a server core complex; below it stay cached

DST, SRC, ROWS, ROW_BYTES, DST_STRIDE, SRC_STRIDE = range(6)


def available() -> bool:
    """Whether the C extension was built and imports."""
    return _native is not None


@dataclass(frozen=True)
class CopyBatch:
    """Copy descriptors (n, 6) int64, copied row-interleaved in groups of `group` (see _native.c)."""

    descs: np.ndarray
    group: int = 1

    @cached_property  # read by the engine (threads or not) and by copy_calls (streaming or not)
    def nbytes(self) -> int:
        return int((self.descs[:, ROWS] * self.descs[:, ROW_BYTES]).sum()) if len(self.descs) else 0


def descriptors(src: FlatPool, dst: FlatPool, plan: TransferPlan, layers: Sequence[int]) -> CopyBatch:
    """The copy descriptors for `layers` of `plan`.

    Where the source's chunks are row-strided (page_first: the rows of a page's (layer,
    buffer) chunks interleave), the descriptors are sorted by source offset and grouped per
    page, so the copy reads each source page in address order. Otherwise they are sorted by
    destination offset, and where both sides' chunks are contiguous adjacent ones merge.
    """
    layer_arr = np.asarray(layers, dtype=np.int64)
    if plan.num_pages == 0 or layer_arr.size == 0:
        return CopyBatch(np.zeros((0, 6), dtype=np.int64))
    page_size = src.geometry.page_size
    parts = []
    for s, d in zip(src.layout.strides, dst.layout.strides, strict=True):
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
    descs = np.concatenate(parts)
    if not all(s.chunk_contiguous for s in src.layout.strides):
        # Walk the source's pages in address order, row by row across their chunks: strided
        # reads are what the prefetcher punishes (measured: 0.45 -> 1.1 of copy_ on reload).
        return CopyBatch(descs[np.argsort(descs[:, SRC], kind="stable")], len(parts) * layer_arr.size)
    if not all(d.chunk_contiguous for d in dst.layout.strides):
        # Strided writes of whole rows stream fine chunk by chunk (row-interleaving measured slower).
        return CopyBatch(descs[np.argsort(descs[:, DST], kind="stable")])
    return CopyBatch(merge(descs[np.argsort(descs[:, DST], kind="stable")]))


def merge(descs: np.ndarray) -> np.ndarray:
    """Join single-row descriptors that continue the previous one on both sides. A merged copy
    takes chunks while its first MERGE_CAP bytes are not yet full, so it ends below
    MERGE_CAP plus one chunk."""
    if len(descs) < 2:
        return descs
    single = descs[:, ROWS] == 1
    size = descs[:, ROW_BYTES]
    follows = np.zeros(len(descs), dtype=bool)
    follows[1:] = (
        single[1:]
        & single[:-1]
        & (descs[1:, DST] == descs[:-1, DST] + size[:-1])
        & (descs[1:, SRC] == descs[:-1, SRC] + size[:-1])
    )
    run_id = np.cumsum(~follows)
    ends = np.cumsum(size)
    run_first = np.flatnonzero(~follows)
    before = ends - size - (ends - size)[run_first][run_id - 1]  # bytes ahead of it in its run
    piece = before // MERGE_CAP
    starts = ~follows
    starts[1:] |= piece[1:] != piece[:-1]
    first = np.flatnonzero(starts)
    out = descs[first].copy()
    out[:, ROW_BYTES] = np.add.reduceat(size, first)
    joined = out[:, ROWS] == 1
    out[joined, DST_STRIDE] = out[joined, ROW_BYTES]
    out[joined, SRC_STRIDE] = out[joined, ROW_BYTES]
    return out


def split(batch: CopyBatch, shares: int) -> list[np.ndarray]:
    """Cut the descriptors into at most `shares` consecutive parts of about equal bytes,
    cutting only between groups."""
    descs, group = batch.descs, batch.group
    if len(descs) == 0:
        return []
    ends = np.cumsum(descs[:, ROWS] * descs[:, ROW_BYTES])
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, shares) / shares, side="right")
    cuts = np.unique(-(-cuts // group) * group)  # up to a group boundary
    return [part for part in np.split(descs, cuts) if len(part)]


def copy_calls(
    src: FlatPool, dst: FlatPool, batch: CopyBatch, shares: int, streaming: bool | None = None
) -> list[Callable[[], None]]:
    """One call per share that copies its descriptors from src to dst (each releases the GIL).

    Each call checks its own share before copying (ValueError); shares are independent.
    streaming: non-temporal stores; None picks them for batches of STREAM_MIN_BYTES or more.
    """
    assert _native is not None, "the hicache C extension is not built"
    if streaming is None:
        streaming = batch.nbytes >= STREAM_MIN_BYTES
    copy = partial(_native.copy_rows, dst.flat.data_ptr(), dst.nbytes, src.flat.data_ptr(), src.nbytes)
    return [partial(copy, part, batch.group, streaming) for part in split(batch, shares)]
