"""The compiled CPU copy path: a transfer as one array of row-block descriptors.

Every (page, layer, buffer) chunk of a transfer becomes a descriptor (descriptors.py: dst,
src, rows, row_bytes, dst_stride, src_stride) computed from the two layouts' strides, in
destination order; chunks adjacent on both sides (page runs) merge into copies of about
MERGE_CAP bytes.
For a large transfer this planning is C (_native_plan.c) that holds the GIL: numpy would
hand the GIL to any other busy Python thread on every large operation. The C extension
(_native.c) copies a whole transfer per call with the GIL released (one below
HOLD_GIL_BYTES, copied by the calling thread alone, keeps it: taking the GIL back beside a
busy Python thread can cost a switch interval, 5 ms, for a copy of tens of µs): it cuts each layer into
pieces of about PIECE_BYTES, which the calling thread and the copy crew (threads of the C
code's own that stay between calls, _native_crew.c) take one at a time in order, so the
Python cost is per transfer, not per page, no Python thread hands work to another, and a
thread whose core is busy takes fewer pieces instead of holding back the rest. A layer-wise
transfer is one such call too: the count of layers done goes into a progress word. A large
asynchronous one is queued (layered, layered_submit) on a C thread that never takes the
GIL, so a busy Python thread cannot delay its start, and its word alone tells when it is
done. Transfers below SMALL_BYTES are copied unsorted, their descriptors made from
a cached page template; below SHARE_MIN_BYTES the calling thread copies them alone, in one C
call that moves the template to each page itself (SmallCopy); those of STREAM_MIN_BYTES or
more use non-temporal stores.

Without the compiled extension (no C compiler at install time) available() is False and
the engine uses torch copies instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from hicache.transfer.descriptors import (  # noqa: F401 (the columns and chunk_parts: read as native.X)
    DST,
    ROW_BYTES,
    ROWS,
    SRC,
    CopyBatch,
    LayeredBatch,
    _descs,
    _strides,
    chunk_parts,
    page_template,
    small_descriptors,
)
from hicache.transfer.plan import TransferPlan

if TYPE_CHECKING:
    from hicache.pools.flat import FlatPool
    from hicache.transfer._native import CopyQueue

_native: ModuleType | None
try:
    from hicache.transfer import _native
except ImportError:  # built by setup.py where a C compiler exists
    _native = None

MERGE_CAP = 1 << 20  # merged copies end once past this (so at most MERGE_CAP + one chunk): even pieces
# A plain transfer below SMALL_BYTES is copied chunk by chunk, unsorted: sorting and merging
# cost more than they save below about 8-16 MB (2-core VM, offload in process: 4 pages
# 370 -> 200 us, 6 pages 540 -> 410 us).
SMALL_BYTES = 8 << 20
# The most bytes a copy on the calling thread alone copies holding the GIL (measured in
# _native.c; benchmarks/transfer.py --gil-sweep); 0 without the extension.
HOLD_GIL_BYTES: int = _native.HOLD_GIL_BYTES if _native is not None else 0
# From SHARE_MIN_BYTES on, a transfer is copied by several threads: the caller and the copy
# crew (_native_crew.c: threads that stay, woken through a futex). 2-core VM,
# benchmarks/transfer.py, layer_first: 4 pages (5.9 MB) 0.48-0.51 of memcpy -> 0.64-0.78,
# 16 pages 0.66-0.69 -> 0.96-1.08. One 1.47 MB page copies in 19 us on two threads, 33 on
# one, back to back; but between other work that keeps the second core (torch's own copy
# threads, as in the benchmark) waking a helper cost it 62 -> 72-89 us, so it stays on one.
# Below HOLD_GIL_BYTES a copy stays on one thread, which keeps the GIL: an offload of two
# pages (2.9 MB) beside a spinning Python thread took 2.0 ms on average on two threads that
# let go of the GIL (12% of them over 1 ms), 1.4 ms on one that kept it (7.7%); alone, 335
# and 315 us at the median (2-core VM under other load, load average 13).
SHARE_MIN_BYTES = max(2 << 20, HOLD_GIL_BYTES)
LAYERED_INLINE_BYTES = 4 << 20  # an asynchronous transfer below this runs in the caller, not queued
STREAM_MIN_BYTES = 16 << 20  # about half the L3 of a server core complex; below it stay cached
# The threads of a copy take its layers in pieces of about this many bytes (cut between
# groups): small enough that a thread slowed by a busy core holds back little, large enough
# that taking one (an atomic on a shared word) costs nothing next to copying it.
PIECE_BYTES = 512 << 10


def available() -> bool:
    """Whether the C extension was built and imports."""
    return _native is not None


@dataclass(frozen=True)
class SmallCopy:
    """The copy of a transfer below SMALL_BYTES for one (source pool, destination pool,
    layers), made once (small_copy): each call is one C call without the GIL that moves the
    cached page template to each page pair, layer by layer, on the calling thread and up to
    threads - 1 of the copy crew, storing the count of layers done into the word at
    `progress` (0: none). No descriptors are built in Python. Raises ValueError (nothing
    copied) for a page outside either pool."""

    head: tuple[int, int, int, int, np.ndarray, np.ndarray, np.ndarray]
    layers: int

    def __call__(self, src_pages: np.ndarray, dst_pages: np.ndarray, progress: int = 0, threads: int = 1) -> None:
        """Copy the page pairs (contiguous int64 arrays, as a TransferPlan holds them)."""
        assert _native is not None, "the hicache C extension is not built"
        _native.copy_pages(*self.head, src_pages, dst_pages, self.layers, False, threads, PIECE_BYTES, progress)


def small_copy(src: FlatPool, dst: FlatPool, layers: tuple[int, ...]) -> SmallCopy:
    """The SmallCopy of `layers` (at least one) from src to dst; the caller keeps it no longer
    than both pools' memory."""
    t = page_template(src.layout, dst.layout, src.geometry.page_size, layers)
    head = (dst.flat.data_ptr(), dst.nbytes, src.flat.data_ptr(), src.nbytes, t.descs, t.src_stride, t.dst_stride)
    return SmallCopy(head, len(layers))


def descriptors(src: FlatPool, dst: FlatPool, plan: TransferPlan, layers: Sequence[int]) -> CopyBatch:
    """The copy descriptors for `layers` of `plan`.

    Where the source's chunks are row-strided (page_first: the rows of a page's (layer,
    buffer) chunks interleave), the descriptors are sorted by source offset and grouped per
    page, so the copy reads each source page in address order. Otherwise they are sorted by
    destination offset, and where both sides' chunks are contiguous adjacent ones merge.
    """
    if plan.num_pages == 0 or len(layers) == 0:
        return CopyBatch(np.zeros((0, 6), dtype=np.int64), moves=0)
    nbytes = plan.num_pages * src.geometry.page_bytes_for(len(layers))
    if nbytes < SMALL_BYTES:
        # a few chunks: sorting and merging cost more than they save
        return CopyBatch(small_descriptors(src, dst, plan, layers), moves=nbytes)
    # Where the source is strided, walk its pages in address order, row by row across their
    # chunks: strided reads are what the prefetcher punishes (measured: 0.45 -> 1.1 of copy_
    # on reload).
    strided_src = not all(s.chunk_contiguous for s in src.layout.strides)
    descs, _ = _built(src, dst, plan, layers, by_layer=False, key_is_src=strided_src)
    if strided_src:
        return CopyBatch(descs, len(src.layout.strides) * len(layers), nbytes)
    if not all(d.chunk_contiguous for d in dst.layout.strides):
        # Strided writes of whole rows stream fine chunk by chunk (row-interleaving measured slower).
        return CopyBatch(descs, moves=nbytes)
    return CopyBatch(merge(descs), moves=nbytes)


def _built(
    src: FlatPool, dst: FlatPool, plan: TransferPlan, layers: Sequence[int], *, by_layer: bool, key_is_src: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One descriptor per (buffer, page, layer) chunk, stably sorted by (layer position when
    by_layer,) source or destination offset; and each one's layer position. Built in C with
    the GIL held (numpy would hand the GIL off on every large operation)."""
    assert _native is not None, "the hicache C extension is not built"
    descs, positions = _native.build_descriptors(
        _strides(src.layout), _strides(dst.layout), src.geometry.page_size,
        np.ascontiguousarray(plan.src_pages, dtype=np.int64), np.ascontiguousarray(plan.dst_pages, dtype=np.int64),
        np.asarray(layers, dtype=np.int64), by_layer, key_is_src,
    )  # fmt: skip
    return _descs(descs), np.frombuffer(positions, dtype=np.int64)


def merge(descs: np.ndarray) -> np.ndarray:
    """Join single-row descriptors that continue the previous one on both sides. A merged
    copy takes chunks while its first MERGE_CAP bytes are not yet full, so it ends below
    MERGE_CAP plus one chunk (_native_plan.c)."""
    assert _native is not None, "the hicache C extension is not built"
    merged, _ = _native.merge_descriptors(np.ascontiguousarray(descs, dtype=np.int64), None, 1, MERGE_CAP)
    return _descs(merged)


def layered(src: FlatPool, dst: FlatPool, plan: TransferPlan, layers: Sequence[int]) -> LayeredBatch:
    """The descriptors of every layer of a large transfer, built at once (see descriptors()
    for the order within a layer), for one copy_pieces call (layered_submit)."""
    count = len(layers)
    if plan.num_pages == 0 or count == 0:
        return LayeredBatch(np.zeros((0, 6), dtype=np.int64), np.zeros(count, dtype=np.int64), moves=0)
    nbytes = plan.num_pages * src.geometry.page_bytes_for(count)
    strided_src = not all(s.chunk_contiguous for s in src.layout.strides)
    descs, positions = _built(src, dst, plan, layers, by_layer=True, key_is_src=strided_src)
    group = len(src.layout.strides) if strided_src else 1
    merging = not strided_src and all(d.chunk_contiguous for d in dst.layout.strides)
    assert _native is not None
    merged, ends = _native.merge_descriptors(descs, positions, count, MERGE_CAP if merging else 0)
    return LayeredBatch(_descs(merged), np.frombuffer(ends, dtype=np.int64), group, nbytes)


def copy_queue() -> CopyQueue:
    """A queue of asynchronous transfers, run in order on a C thread that never takes the GIL
    (_native_queue.c); see layered_submit."""
    assert _native is not None, "the hicache C extension is not built"
    return _native.CopyQueue()


def layered_submit(
    queue: CopyQueue, src: FlatPool, dst: FlatPool, batch: LayeredBatch, threads: int, progress: int, keep: object
) -> None:
    """Queue the batch, to be copied on up to `threads` threads (the queue's and the copy
    crew's) without the GIL, and return at once: the count of layers done goes into the word
    at `progress`, which is then the only sign of its end. `keep`
    (what owns the two pools' memory and the word) is referenced until it is done. Raises
    ValueError (nothing queued) for a descriptor outside either pool."""
    queue.submit(*_layered_args(src, dst, batch, threads, progress, None), keep)


def _layered_args(
    src: FlatPool, dst: FlatPool, batch: LayeredBatch, threads: int, progress: int, streaming: bool | None
) -> tuple[int, int, int, int, np.ndarray, np.ndarray, int, bool, int, int, int]:
    if streaming is None:
        streaming = batch.nbytes >= STREAM_MIN_BYTES
    return (
        dst.flat.data_ptr(), dst.nbytes, src.flat.data_ptr(), src.nbytes,
        np.ascontiguousarray(batch.descs), np.ascontiguousarray(batch.ends), batch.group, streaming,
        threads, PIECE_BYTES, progress,
    )  # fmt: skip


def publish(address: int, value: int) -> None:
    """Store value into the 32-bit word at `address` and wake its futex waiters."""
    assert _native is not None, "the hicache C extension is not built"
    _native.publish(address, value)


def wait_progress(address: int, target: int, timeout_s: float) -> int:
    """Wait (without the GIL) until the word at `address` is >= target, up to timeout_s."""
    assert _native is not None, "the hicache C extension is not built"
    return int(_native.wait_progress(address, target, timeout_s))


def batch_call(
    src: FlatPool, dst: FlatPool, batch: CopyBatch, threads: int, streaming: bool | None = None
) -> Callable[[], None]:
    """One call that copies the batch on up to `threads` threads (the calling one and the copy
    crew's), without the GIL."""
    assert _native is not None, "the hicache C extension is not built"
    if streaming is None:
        streaming = batch.nbytes >= STREAM_MIN_BYTES
    ends = np.array([len(batch.descs)], dtype=np.int64)
    return partial(
        _native.copy_pieces,
        dst.flat.data_ptr(), dst.nbytes, src.flat.data_ptr(), src.nbytes,
        np.ascontiguousarray(batch.descs), ends, batch.group, streaming, threads, PIECE_BYTES, 0,
    )  # fmt: skip
