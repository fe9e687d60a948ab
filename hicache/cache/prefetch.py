"""Prefetch progress: what a storage -> host prefetch has done, observable while it runs.

A PrefetchHandle is shared by the worker that fills host pages and the callers that watch
it (the sidecar's Watch RPC streams status snapshots from wait_for_update()). All of its
state sits behind one Condition; snapshots are immutable PrefetchStatus values.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache.cache.policies import PrefetchPolicy


@dataclass(frozen=True)
class PrefetchStatus:
    """A snapshot. total = pages to fetch from storage; done + failed == total once finished."""

    id: int
    keys: int  # keys asked for
    total: int
    done: int
    failed: int
    finished: bool
    cancelled: bool


@dataclass(frozen=True)
class PrefetchResult:
    """What a policy wait ends with: `ready` leading keys are on host now."""

    status: PrefetchStatus
    ready: int
    timed_out: bool


class PrefetchHandle:
    """One prefetch. Made by HierarchicalCache.prefetch(); thread-safe."""

    def __init__(
        self,
        id: int,
        keys: list[bytes],
        fetch: list[bytes],
        policy: PrefetchPolicy,
        timeout_s: float,
        ready: Callable[[list[bytes]], int],
    ):
        self.id, self.keys, self.fetch, self.policy, self.timeout_s = id, keys, fetch, policy, timeout_s
        self.started = time.monotonic()
        self._ready = ready
        self.depends: list[PrefetchHandle] = []  # in-flight prefetches filling some of `keys`
        self.no_room: list[bytes] = []  # keys in storage that found no host page (pinned/referenced pool)
        self._cond = threading.Condition()
        self._done = 0
        self._failed = 0
        self._finished = not fetch
        self._cancelled = False

    # ---- observers ----------------------------------------------------------------------------
    def status(self) -> PrefetchStatus:
        with self._cond:
            return self._snapshot()

    def _snapshot(self) -> PrefetchStatus:
        return PrefetchStatus(
            self.id, len(self.keys), len(self.fetch), self._done, self._failed, self._finished, self._cancelled
        )

    @property
    def cancelled(self) -> bool:
        with self._cond:
            return self._cancelled

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this prefetch, and those it depends on (earlier prefetches filling
        some of its keys), finish; False if `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in [self, *self.depends]:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with h._cond:
                if not h._cond.wait_for(lambda h=h: h._finished, left):  # type: ignore[misc]
                    return False
        return True

    def wait_for_update(self, seen: PrefetchStatus | None, timeout: float | None = None) -> PrefetchStatus:
        """The next status that differs from `seen` (at once if it already does, or when
        finished), or the current one after `timeout` seconds. For streaming progress."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished or self._snapshot() != seen, timeout)
            return self._snapshot()

    def cancel(self) -> None:
        """Stop fetching after the batch in flight; pages already fetched stay on host."""
        with self._cond:
            if not self._finished:
                self._cancelled = True
            self._cond.notify_all()

    def result(self) -> PrefetchResult:
        """Wait as the policy says, then cancel what is left (except wait_complete):
        best_effort does not wait; wait_complete waits for the end; timeout waits until
        timeout_s after the start. Returns how many leading keys are on host."""
        timed_out = False
        if self.policy == "wait_complete":
            self.wait()
        elif self.policy == "timeout":
            timed_out = not self.wait(max(0.0, self.started + self.timeout_s - time.monotonic()))
        if not self.wait(0):
            self.cancel()  # only this prefetch's own pages: the ones it depends on are others'
        return PrefetchResult(self.status(), self._ready(self.keys), timed_out)

    # ---- the worker's side ----------------------------------------------------------------------
    def advance(self, done: int, failed: int = 0) -> None:
        with self._cond:
            self._done += done
            self._failed += failed
            self._cond.notify_all()

    def finish(self) -> None:
        """Count every page neither done nor failed as failed, and mark the prefetch finished."""
        with self._cond:
            self._failed = len(self.fetch) - self._done
            self._finished = True
            self._cond.notify_all()
