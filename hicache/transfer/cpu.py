"""The torch CPU copy path (used without the C extension, see native.py) and the pool of
copy threads that both CPU paths run their shares on.

A transfer becomes a list of (destination, source) strided views, one per (page run,
layer run, buffer). `CpuCopier` cuts the list into byte-balanced shares and hands one
share to each of its threads; `copy_` releases the GIL, so the shares run in parallel.
Each copy thread uses one intra-op thread: a copy already split across threads does not
also fork an OpenMP team per view (that fork/join per view is what makes a plain
`torch._foreach_copy_` loop collapse when the cores are busy).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from hicache.pools.flat import FlatPool
from hicache.transfer.plan import TransferPlan
from hicache.validate import is_int

INLINE_BYTES = 1 << 20  # below this a transfer runs in the calling thread


def full_views(pool: FlatPool) -> tuple[torch.Tensor, ...]:
    """Per buffer, the whole pool as one [pages, layers, page_size, row_bytes] uint8 view."""
    g = pool.geometry
    return tuple(pool.chunks(b, 0, 0, pool.num_pages, g.layer_num) for b in range(len(g.buffers)))


def copy_views(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    plan: TransferPlan,
    layer_runs: Sequence[tuple[int, int]] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (destination, source) view pairs that carry out `plan`, layer run by layer run.

    `src`/`dst` are the pools' full_views. `layer_runs` (default plan.layer_runs) restricts
    the copy to those (first, count) runs. A single page gives a [layers, page_size,
    row_bytes] view, a page run [pages, layers, page_size, row_bytes]. (Indexing the cached
    full views costs a third of building each view with as_strided.)
    """
    assert len(src) == len(dst) and src and src[0].dim() == 4
    layer_num = src[0].shape[1]
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for first, count in plan.layer_runs if layer_runs is None else layer_runs:
        layers = slice(first, first + count)
        whole = count == layer_num
        for s_page, d_page, n in plan.runs:
            for s_full, d_full in zip(src, dst, strict=True):
                if n == 1:
                    dsts.append(d_full[d_page] if whole else d_full[d_page, layers])
                    srcs.append(s_full[s_page] if whole else s_full[s_page, layers])
                else:
                    dsts.append(d_full[d_page : d_page + n, layers])
                    srcs.append(s_full[s_page : s_page + n, layers])
    return dsts, srcs


def split_shares(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], shares: int
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Cut the copy list into at most `shares` parts of about equal bytes.

    A view larger than a share is first cut along its page (then layer) dimension, so one
    long page run does not leave the other threads idle. Empty parts are dropped.
    """
    assert len(dsts) == len(srcs) and shares >= 1
    total = sum(d.numel() for d in dsts)
    if total == 0:
        return []
    target = -(-total // shares)
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    for d, s in zip(dsts, srcs, strict=True):
        pieces.extend(_cut(d, s, max(1, target // 2)))
    out: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(shares)]
    start = 0
    for d, s in pieces:
        share = min(shares - 1, (start + d.numel() // 2) // target)  # the share holding its midpoint
        out[share][0].append(d)
        out[share][1].append(s)
        start += d.numel()
    return [share for share in out if share[0]]


def _cut(d: torch.Tensor, s: torch.Tensor, target: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    for dim in range(d.dim() - 2):  # pages (for a run), then layers
        if d.numel() > target and d.shape[dim] > 1:
            per = max(1, target * d.shape[dim] // d.numel())
            return list(zip(d.split(per, dim), s.split(per, dim), strict=True))
    return [(d, s)]


def _single_intra_op_thread(barrier: threading.Barrier) -> None:
    torch.get_num_threads()  # let torch initialise this thread's OpenMP settings first
    torch.set_num_threads(1)  # then keep this thread's copies on this thread
    barrier.wait()


def _copy_share(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    torch._foreach_copy_(dsts, srcs)


class CpuCopier:
    """A persistent pool of `threads` copy threads (default: torch's intra-op thread count).

    Raises ValueError for threads < 1. Call close() to stop the threads (idempotent).
    """

    def __init__(self, threads: int | None = None):
        count = torch.get_num_threads() if threads is None else threads
        if not is_int(count) or count < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self.threads = count
        self._pool: ThreadPoolExecutor | None = None
        if count > 1:
            self._pool = self._start(count)

    @staticmethod
    def _start(count: int) -> ThreadPoolExecutor:
        # torch.set_num_threads also sets the default that torch gives new threads; the caller's
        # value is put back once every copy thread has taken its own setting of 1.
        caller = torch.get_num_threads()
        pool = ThreadPoolExecutor(count, thread_name_prefix="hicache-copy")
        barrier = threading.Barrier(count)
        for future in [pool.submit(_single_intra_op_thread, barrier) for _ in range(count)]:
            future.result()
        torch.set_num_threads(caller)
        return pool

    def run(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Copy srcs[i] into dsts[i] for every i; returns when all are done.

        Re-raises the first exception a copy thread raised.
        """
        if not dsts:
            return
        if self._pool is None or sum(d.numel() for d in dsts) < INLINE_BYTES:
            torch._foreach_copy_(dsts, srcs)
            return
        self.run_calls([partial(_copy_share, d, s) for d, s in split_shares(dsts, srcs, self.threads)])

    def run_calls(self, calls: Sequence[Callable[[], None]]) -> None:
        """Run each call on a copy thread (in this thread without them); returns when all
        are done. Re-raises the first exception a call raised."""
        if self._pool is None or len(calls) < 2:
            for call in calls:
                call()
            return
        futures: list[Future[None]] = [self._pool.submit(call) for call in calls]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def close(self) -> None:
        """Stop the copy threads. Later run() calls copy in the calling thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
