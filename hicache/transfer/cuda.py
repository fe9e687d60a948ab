"""The CUDA copy path: Triton gather/scatter kernels or cudaMemcpyAsync, on dedicated streams.

- Large contiguous pieces (a (page run, layer) chunk contiguous on both sides, as between
  the layer_first device pool and a layer_first or page_first_direct host pool) go as one
  `copy_(non_blocking=True)` each, which torch issues as a cudaMemcpyAsync on pinned memory.
- Everything else, and small chunks, goes through the Triton kernels (one program per
  (page, layer) chunk, one launch per buffer), which beat many small memcpys.
  The copy engines' cuMemcpyBatchAsync was measured on an H200 and lost to the kernels at
  these piece sizes (README, "GPU figures"), so it is not used.
- Offloads run on a write stream and reloads on a load stream, each ordered after the
  caller's current stream; a layer-wise reload records one event per layer.

Importable without CUDA: torch.cuda is only touched when a transfer runs on a GPU pool.
The piece planning and the memcpy path are plain numpy and torch and are tested on CPU.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from hicache.pools.flat import FlatPool
from hicache.transfer.plan import TransferPlan

MEMCPY_MIN_BYTES = 256 << 10  # mean contiguous piece from which memcpy beats the kernels
Path = Literal["memcpy", "kernel"]
Segment = tuple[int, int, int]  # (src byte offset, dst byte offset, bytes)
Pieces = tuple[np.ndarray, np.ndarray, np.ndarray]  # src offsets, dst offsets, bytes: (layers, pieces) each
GroupCopy = Callable[[slice], Path]  # queues the layer group plan.layers[rows]; names its path
StreamHook = Callable[[int], None]  # called with the copy stream (a cudaStream_t as int)
LayerHook = Callable[[int, int], None]  # (the layer's position in the plan, the copy stream)


def memcpy_pieces(src: FlatPool, dst: FlatPool, plan: TransferPlan, layers: tuple[int, ...]) -> Pieces | None:
    """The contiguous byte ranges that carry out `plan` for `layers`: (src offsets, dst
    offsets, bytes), each int64 of shape (len(layers), pieces per layer), one row per layer.

    None when some buffer's (page, layer) chunk is strided on either side: then only the
    kernels can do it. Page runs that are contiguous on both sides become one range.
    """
    g = src.geometry
    pairs = list(zip(src.layout.strides, dst.layout.strides, strict=True))
    if not all(ss.chunk_contiguous and ds.chunk_contiguous for ss, ds in pairs):
        return None
    runs = np.asarray(plan.runs, dtype=np.int64).reshape(-1, 3)
    layer_col = np.asarray(layers, dtype=np.int64)[:, None]
    cols: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    for buffer, (ss, ds) in zip(g.buffers, pairs, strict=True):
        chunk = g.chunk_bytes(buffer)
        if ss.page_stride == chunk and ds.page_stride == chunk:
            s_pages, d_pages, sizes = runs[:, 0], runs[:, 1], runs[:, 2] * chunk
        else:
            s_pages, d_pages = plan.src_pages.astype(np.int64), plan.dst_pages.astype(np.int64)
            sizes = np.full(plan.num_pages, chunk, dtype=np.int64)
        cols[0].append(ss.base + s_pages * ss.page_stride + layer_col * ss.layer_stride)
        cols[1].append(ds.base + d_pages * ds.page_stride + layer_col * ds.layer_stride)
        cols[2].append(np.broadcast_to(sizes, (len(layers), sizes.size)))
    s_off, d_off, nbytes = (np.concatenate(c, axis=1) for c in cols)
    return s_off, d_off, nbytes


def memcpy_segments(src: FlatPool, dst: FlatPool, plan: TransferPlan, layers: tuple[int, ...]) -> list[Segment] | None:
    """memcpy_pieces as a list of (src offset, dst offset, bytes), in layer order (for tests
    and tools; the copier slices memcpy_pieces' arrays itself)."""
    pieces = memcpy_pieces(src, dst, plan, layers)
    return None if pieces is None else as_segments(pieces, slice(None))


def as_segments(pieces: Pieces, rows: slice) -> list[Segment]:
    """The rows (layers) `rows` of memcpy_pieces' arrays as (src offset, dst offset, bytes)."""
    return list(zip(*(a[rows].ravel().tolist() for a in pieces), strict=True))


def mean_piece_bytes(src: FlatPool, dst: FlatPool, plan: TransferPlan) -> float | None:
    """The mean size of the pieces memcpy_segments would cut `plan` into (the same for any
    set of layers), counted from the page runs without listing the pieces; None when some
    chunk is strided on either side."""
    g = src.geometry
    pairs = list(zip(src.layout.strides, dst.layout.strides, strict=True))
    if plan.num_pages == 0 or not all(ss.chunk_contiguous and ds.chunk_contiguous for ss, ds in pairs):
        return None
    pieces = total = 0
    for buffer, (ss, ds) in zip(g.buffers, pairs, strict=True):
        chunk = g.chunk_bytes(buffer)
        merged = ss.page_stride == chunk and ds.page_stride == chunk
        pieces += len(plan.runs) if merged else plan.num_pages
        total += plan.num_pages * chunk
    return total / pieces


def choose_path(mean_bytes: float | None, min_bytes: int = MEMCPY_MIN_BYTES) -> Path:
    """ "memcpy" when every piece is contiguous (mean_bytes is not None) and they average at
    least `min_bytes`; else "kernel"."""
    return "memcpy" if mean_bytes is not None and mean_bytes >= min_bytes else "kernel"


def copy_segments(src: FlatPool, dst: FlatPool, segments: list[Segment]) -> None:
    """Copy each (src offset, dst offset, bytes) range; on CUDA an async memcpy on the current stream."""
    s_flat, d_flat = src.flat, dst.flat
    for s, d, n in segments:
        d_flat[d : d + n].copy_(s_flat[s : s + n], non_blocking=True)


def layer_plan(plan: TransferPlan, layers: tuple[int, ...]) -> TransferPlan:
    """`plan` restricted to `layers` (a subset of plan.layers)."""
    return dataclasses.replace(plan, layers=layers, layer_runs=tuple((layer, 1) for layer in layers))


class CudaCopier:
    """Runs transfers between a CUDA pool and a (pinned) host pool on dedicated streams.

    mode "auto" picks memcpy or kernels per transfer (choose_path); "triton" always uses
    the kernels. `paths` counts the layer groups each path copied.
    """

    def __init__(self, device: Any, mode: Literal["auto", "triton"] = "auto"):
        import torch

        self.device = device
        self.mode = mode
        self.write_stream = torch.cuda.Stream(device=device)
        self.load_stream = torch.cuda.Stream(device=device)
        self.paths: Counter[Path] = Counter()
        self._paths_lock = threading.Lock()  # offloads and reloads run from different threads

    def run(
        self,
        src: FlatPool,
        dst: FlatPool,
        plan: TransferPlan,
        *,
        load: bool,
        per_layer: bool,
        sync: bool,
        before: StreamHook | None = None,
        after_layer: LayerHook | None = None,
    ) -> list[Any]:
        """Queue `plan` on the load (or write) stream; return one event per layer group.

        per_layer: one group per layer (events for wait_layer), else one group in all.
        sync: block the host until the copy is done. before: called with the stream once it
        is ordered after the caller's (to make it wait for more, e.g. another process's
        event); after_layer: called after each layer group is queued (per_layer: to record
        another event there).
        """
        import torch

        stream = self.load_stream if load else self.write_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if before is not None:
            before(stream.cuda_stream)
        groups = [slice(i, i + 1) for i in range(len(plan.layers))] if per_layer else [slice(0, len(plan.layers))]
        copy = group_copier(src, dst, plan, self.mode)
        events = []
        with torch.cuda.stream(stream):
            for position, rows in enumerate(groups):
                path = copy(rows)
                with self._paths_lock:
                    self.paths[path] += 1
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
                if after_layer is not None:
                    after_layer(position, stream.cuda_stream)
        if sync:
            stream.synchronize()
        return events


def group_copier(src: FlatPool, dst: FlatPool, plan: TransferPlan, mode: Literal["auto", "triton"]) -> GroupCopy:
    """The function that queues one layer group of `plan` (plan.layers[rows]) on the current
    stream and names the path it took: memcpy (mode "auto" and large contiguous pieces,
    choose_path) or the kernels. The choice is counted, not listed: listing a large
    transfer's pieces first would cost time even when the kernels copy it."""
    if mode == "triton" or choose_path(mean_piece_bytes(src, dst, plan)) == "kernel":

        def kernel(rows: slice) -> Path:
            from hicache.transfer.triton_kernels import copy_pages_triton

            copy_pages_triton(src, dst, layer_plan(plan, plan.layers[rows]))
            return "kernel"

        return kernel
    pieces = memcpy_pieces(src, dst, plan, plan.layers)
    assert pieces is not None  # choose_path said every chunk is contiguous

    def memcpy(rows: slice) -> Path:
        copy_segments(src, dst, as_segments(pieces, rows))
        return "memcpy"

    return memcpy
