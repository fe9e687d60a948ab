"""The CUDA copy path: Triton gather/scatter kernels or cudaMemcpyAsync, on dedicated streams.

- Large contiguous pieces (a (page run, layer) chunk contiguous on both sides, as between
  the layer_first device pool and a layer_first or page_first_direct host pool) go as one
  `copy_(non_blocking=True)` each, which torch issues as a cudaMemcpyAsync on pinned memory.
- Everything else, and small chunks, goes through the Triton kernels (one program per
  (page, layer) chunk, one launch per buffer), which beat many small memcpys.
- Offloads run on a write stream and reloads on a load stream, each ordered after the
  caller's current stream; a layer-wise reload records one event per layer.

Importable without CUDA: torch.cuda is only touched when a transfer runs on a GPU pool.
The segment planning and the memcpy path are plain torch and are tested on CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from hicache.pools.flat import FlatPool
from hicache.transfer.plan import TransferPlan

MEMCPY_MIN_BYTES = 256 << 10  # mean contiguous piece from which memcpy beats the kernels
Path = Literal["memcpy", "kernel"]
Segment = tuple[int, int, int]  # (src byte offset, dst byte offset, bytes)
StreamHook = Callable[[int], None]  # called with the copy stream (a cudaStream_t as int)
LayerHook = Callable[[int, int], None]  # (the layer's position in the plan, the copy stream)


def memcpy_segments(src: FlatPool, dst: FlatPool, plan: TransferPlan, layers: tuple[int, ...]) -> list[Segment] | None:
    """The contiguous byte ranges that carry out `plan` for `layers`, in layer order.

    None when some buffer's (page, layer) chunk is strided on either side: then only the
    kernels can do it. Page runs that are contiguous on both sides become one range.
    """
    g = src.geometry
    pairs = list(zip(src.layout.strides, dst.layout.strides, strict=True))
    if not all(ss.chunk_contiguous and ds.chunk_contiguous for ss, ds in pairs):
        return None
    segments: list[Segment] = []
    for layer in layers:
        for s_page, d_page, n in plan.runs:
            for buffer, (ss, ds) in zip(g.buffers, pairs, strict=True):
                chunk = g.chunk_bytes(buffer)
                if ss.page_stride == chunk and ds.page_stride == chunk:
                    segments.append((ss.offset(s_page, layer), ds.offset(d_page, layer), n * chunk))
                else:
                    for k in range(n):
                        segments.append((ss.offset(s_page + k, layer), ds.offset(d_page + k, layer), chunk))
    return segments


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
    the kernels.
    """

    def __init__(self, device: Any, mode: Literal["auto", "triton"] = "auto"):
        import torch

        self.device = device
        self.mode = mode
        self.write_stream = torch.cuda.Stream(device=device)
        self.load_stream = torch.cuda.Stream(device=device)

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
        groups = [(layer,) for layer in plan.layers] if per_layer else [plan.layers]
        events = []
        with torch.cuda.stream(stream):
            for position, layers in enumerate(groups):
                self._copy(src, dst, plan, layers)
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
                if after_layer is not None:
                    after_layer(position, stream.cuda_stream)
        if sync:
            stream.synchronize()
        return events

    def _copy(self, src: FlatPool, dst: FlatPool, plan: TransferPlan, layers: tuple[int, ...]) -> None:
        # the choice is counted, not listed: listing a large transfer's pieces in Python
        # costs about as long as the kernels take to copy them
        if self.mode == "auto" and choose_path(mean_piece_bytes(src, dst, plan)) == "memcpy":
            segments = memcpy_segments(src, dst, plan, layers)
            assert segments is not None
            copy_segments(src, dst, segments)
        else:
            from hicache.transfer.triton_kernels import copy_pages_triton

            copy_pages_triton(src, dst, layer_plan(plan, layers))
