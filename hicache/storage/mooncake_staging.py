"""The Mooncake tier's staged transfers: stored pages copied through one contiguous registered
buffer per calling thread, hashed as they are copied (page_format's stage_page and
unstage_page, one pass over each byte), half of a call's pages on a worker thread at the
same time; then one Mooncake call for them all (a call's own cost, the master's allocation
and lookup, outweighs overlapping copies with several smaller calls).

The tier stages where a zero-copy transfer cannot go or costs more: over RDMA, which moves
only registered memory, and for pages in more than DIRECT_MAX_PIECES pieces (a layer_first
host page is two per layer), since Mooncake's TCP transfer pays per slice: on a 2-core VM a
put of 1.47 MB pages as 19 slices each ran at about 0.6 of the same bytes in one slice each
(benchmarks/tiers.py --backend mooncake; docs/performance.md has the staged figures).
"""

from __future__ import annotations

import itertools
import mmap
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from hicache.storage.lazy_threads import LazyThreads
from hicache.storage.mooncake_link import RPC_FAIL, MooncakeLink, address

DIRECT_MAX_PIECES = 2  # payload pieces of a page that still move zero-copy
Run = Callable[[Callable[[Any], Any], int, str], "list[int] | None"]
# finish(i, code, stored page i as read; code None when the call did not happen) -> page i verified
Finish = Callable[[int, "int | None", memoryview], bool]
Fill = Callable[[int, memoryview], None]  # fill(i, buffer): write stored page i into the buffer


class Stager:
    """Staged puts and gets for one tier over `link`."""

    def __init__(self, link: MooncakeLink):
        self._link = link
        self._local = threading.local()
        self._worker = LazyThreads(1, "hicache-mooncake-stage")
        self._unregisters: list[weakref.finalize] = []  # one per staging buffer made

    def close(self) -> None:
        """Unregister every staging buffer of this tier (the link outlives it) and stop the worker."""
        self._worker.close()
        for unregister in self._unregisters:
            unregister()

    def _arena(self, sizes: Sequence[int]) -> tuple[mmap.mmap, list[int]]:
        """This thread's staging buffer (anonymous memory, page-aligned), with room for pages
        of `sizes` back to back, and each page's offset in it. A buffer is unregistered when
        it is replaced, dropped with its thread, or the tier closes; the calls register it
        once the client is known (MooncakeLink.register)."""
        arena: mmap.mmap | None = getattr(self._local, "arena", None)
        if arena is None or len(arena) < sum(sizes):
            arena = self._local.arena = mmap.mmap(-1, max(sum(sizes), 1 << 20))  # the old one: finalized
            unregister = weakref.finalize(arena, self._link.forget, (address(arena), len(arena)))
            self._unregisters = [u for u in self._unregisters if u.alive] + [unregister]
        return arena, list(itertools.accumulate(sizes[:-1], initial=0))

    def put(self, names: Sequence[str], sizes: Sequence[int], fill: Fill, run: Run) -> list[int]:
        """Store page i under names[i]: sizes[i] bytes that fill(i, buffer) writes; Mooncake's
        code for each (RPC_FAIL when the cluster is down)."""
        arena, offsets = self._arena(sizes)
        whole, base = memoryview(arena), address(arena)
        self._halves(len(names), lambda i: fill(i, whole[offsets[i] : offsets[i] + sizes[i]]))
        ptrs = [base + at for at in offsets]

        def send(store: Any) -> list[int]:
            self._link.register(arena, store)
            return list(store.batch_put_from(list(names), ptrs, list(sizes)))

        got = run(send, len(names), "writes")
        return got if got is not None else [RPC_FAIL] * len(names)

    def get(self, names: Sequence[str], sizes: Sequence[int], run: Run, finish: Finish) -> list[bool]:
        """Read names[i] (sizes[i] bytes stored), then finish(i, code, the bytes read) each;
        whether each page finished good."""
        arena, offsets = self._arena(sizes)
        whole, base = memoryview(arena), address(arena)
        ptrs = [base + at for at in offsets]

        def receive(store: Any) -> list[int]:
            self._link.register(arena, store)
            return list(store.batch_get_into(list(names), ptrs, list(sizes)))

        codes = run(receive, len(names), "reads")
        good = [False] * len(names)

        def check(i: int) -> None:
            good[i] = finish(i, None if codes is None else codes[i], whole[offsets[i] : offsets[i] + sizes[i]])

        self._halves(len(names), check)
        return good

    def _halves(self, n: int, work: Callable[[int], None]) -> None:
        """work(i) for i in range(n): the second half on the worker while this thread does the first."""
        half = n // 2

        def second() -> None:
            for i in range(half, n):
                work(i)

        other = self._worker.get().submit(second) if half else None
        try:
            for i in range(half if other is not None else n):
                work(i)
        finally:
            if other is not None:
                other.result()
