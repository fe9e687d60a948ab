"""StorageWriter: a background thread that writes pages to a storage tier in batches.

submit() queues what fits under max_queue. When the queue is full it waits for room while
the writer is making progress (a batch finished or started within STALL_S), for at most
wait_s: a burst of offloads is slowed to the tier's pace instead of losing its writes. A
writer that makes no progress (a hung Redis, a stalled disk) is not waited for: what does
not fit is handed back at once (the caller drops and counts it), so an offload reply never
waits on a tier that is not writing. The thread takes up to batch_pages jobs at a time,
gets each job's bytes (given, or read from the host page by the `read` callback, outside
any cache lock), calls tier.batch_set once (after one batch_contains for jobs to write only
if the tier lost the key), and reports per-job success to `done`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hicache.storage.base import Payload, StorageTier

STALL_S = 0.5  # a writer that has not started or finished a batch for this long is stalled


@dataclass
class WriteJob:
    """One page to store: its bytes now (`data`), or a host page to read when written.
    if_missing: write it only if the tier does not hold the key any more (done either way)."""

    key: bytes
    page: int | None = None
    data: Payload | None = None
    if_missing: bool = False


class StorageWriter:
    """Writes WriteJobs to `tier` on one daemon thread. Thread-safe.

    `read(job)` returns the bytes of a job without data (or None to skip it); `done(jobs,
    ok)` is called after each batch with one bool per job (False for skipped or failed).
    Raises ValueError for max_queue or batch_pages < 1.
    """

    def __init__(
        self,
        tier: StorageTier,
        read: Callable[[WriteJob], Payload | None],
        done: Callable[[list[WriteJob], list[bool]], None],
        *,
        max_queue: int = 1024,
        batch_pages: int = 32,
        wait_s: float = 10.0,
        name: str = "hicache-storage-writer",
    ):
        if max_queue < 1 or batch_pages < 1:
            raise ValueError(f"max_queue and batch_pages must be >= 1, got {max_queue} and {batch_pages}")
        self.tier, self._read, self._done = tier, read, done
        self.max_queue, self.batch_pages, self.wait_s = max_queue, batch_pages, wait_s
        self._progress = time.monotonic()  # when the thread last started or finished a batch
        self._batches = 0  # batches finished
        self._cond = threading.Condition()  # guards _queue, _busy, _closed
        self._queue: deque[WriteJob] = deque()
        self._busy = 0  # jobs taken off the queue and not yet reported
        self._closed = False
        self.errors = 0  # exceptions from `read` or the tier, turned into failed jobs
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs queued or being written."""
        with self._cond:
            return len(self._queue) + self._busy

    def submit(self, jobs: Sequence[WriteJob]) -> list[WriteJob]:
        """Queue the jobs, waiting for room while the writer makes progress (at most wait_s);
        return the ones that did not fit (the caller drops them)."""
        taken = 0
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while not self._closed:
                room = max(0, self.max_queue - len(self._queue) - self._busy)
                self._queue.extend(jobs[taken : taken + room])
                taken = min(len(jobs), taken + room)
                self._cond.notify_all()
                if taken == len(jobs) or not self._wait_for_progress_locked(deadline):
                    break
        return list(jobs[taken:])

    def wait_written(self, timeout: float) -> bool:
        """Wait until the writer finishes a batch: True when it did, False when it has
        nothing to write, is stalled (see STALL_S) or `timeout` s pass first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = self._batches
            while self._batches == seen:
                idle = not self._queue and not self._busy
                if idle or self._closed or not self._wait_for_progress_locked(deadline):
                    return False
        return True

    def _wait_for_progress_locked(self, deadline: float) -> bool:
        """Wait a little for the writer (under _cond); False, without waiting, once
        `deadline` has passed or the writer is stalled (no batch started or finished for
        STALL_S)."""
        now = time.monotonic()
        if now >= deadline or now - self._progress > STALL_S:
            return False
        self._cond.wait(min(STALL_S / 5, deadline - now))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is written; False if `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued (up to `timeout` seconds), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if dropped:
            self._done(dropped, [False] * len(dropped))
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(self.batch_pages, len(self._queue)))]
                self._busy += len(batch)
                self._progress = time.monotonic()
            ok = self._write(batch)
            try:
                self._done(batch, ok)
            finally:
                with self._cond:
                    self._busy -= len(batch)
                    self._progress = time.monotonic()
                    self._batches += 1
                    self._cond.notify_all()

    def _write(self, batch: list[WriteJob]) -> list[bool]:
        ok = [False] * len(batch)
        held = self._still_held(batch)
        items: list[tuple[bytes, Payload]] = []
        where: list[int] = []
        for i, job in enumerate(batch):
            if i in held:
                ok[i] = True  # the tier has it: nothing to write
                continue
            try:
                data = job.data if job.data is not None else self._read(job)
            except Exception as e:  # a read must not kill the thread; the job just fails
                self._note(e)
                data = None
            if data is not None:
                items.append((job.key, data))
                where.append(i)
        if items:
            try:
                results = self.tier.batch_set(items)
            except Exception as e:  # tiers count their own failures; never let one stop writing
                self._note(e)
                results = [False] * len(items)
            for i, r in zip(where, results, strict=True):
                ok[i] = r
        return ok

    def _still_held(self, batch: list[WriteJob]) -> set[int]:
        """Positions of the if_missing jobs whose keys the tier holds (one batch_contains;
        none if it fails: then they are written)."""
        ask = [i for i, job in enumerate(batch) if job.if_missing]
        if not ask:
            return set()
        try:
            found = self.tier.batch_contains([batch[i].key for i in ask])
        except Exception as e:
            self._note(e)
            return set()
        return {i for i, there in zip(ask, found, strict=True) if there}

    def _note(self, e: Exception) -> None:
        with self._cond:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
