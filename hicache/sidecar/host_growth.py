"""Host pools take their memory in steps, after the registration has answered.

Reserving a host pool whole (fallocate, then faulting every page in) takes seconds per GB:
an 11 GB pool outlived a client's 5 s deadline. So a new pool reserves only its first
FIRST_BYTES before RegisterPool answers, and one background thread grows each pool towards
its goal (its share of the host budget, or its ratio of the device pool) STEP_BYTES at a
time, under the service's space lock, so a registration or a release waits for one step at
most. A rebalance that shrinks a pool does so at once; one that grows it only moves its goal.
A step that does not fit (ENOSPC) stops that pool at the size it has, with a warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.sidecar.errors import StateError

if TYPE_CHECKING:
    from hicache.sidecar.shared_cache import SharedHostCache

log = logging.getLogger("hicache.sidecar.service")

FIRST_BYTES = 64 << 20  # reserved before RegisterPool answers
STEP_BYTES = 256 << 20  # then reserved per step, in the background


def first_pages(host_pages: int, page_bytes: int) -> int:
    """The pages a new pool of host_pages pages reserves before answering (at least 1)."""
    return min(host_pages, max(1, FIRST_BYTES // page_bytes))


class HostGrower:
    """The background thread that grows host caches to their host_goal (started on first need)."""

    def __init__(self, space_lock: threading.Lock, caches: Callable[[], list[SharedHostCache]]):
        self._space_lock = space_lock
        self._caches = caches
        self._cond = threading.Condition()
        self._wanted = False  # guarded by _cond: a pool may be below its goal
        self._growing = False  # guarded by _cond: the thread is between two looks
        self._closed = False
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """Look again for pools below their goal."""
        with self._cond:
            if self._closed:
                return
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hicache-host-grower", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every pool has reached its goal (or stopped short of it); False if
        `timeout` s pass first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._wanted and not self._growing, timeout=timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted or self._closed)
                if self._closed:
                    self._growing = False
                    self._cond.notify_all()
                    return
                self._wanted, self._growing = False, True
            while self._step():
                if self._closed:
                    break
            with self._cond:
                self._growing = False
                self._cond.notify_all()

    def _step(self) -> bool:
        """Grow the first cache below its goal by one step; False when none is."""
        with self._space_lock:
            for shared in self._caches():
                have = shared.host_pages
                if have >= shared.host_goal:
                    continue
                step = max(1, STEP_BYTES // shared.geometry.page_bytes)
                try:
                    shared.resize_host(min(shared.host_goal, have + step))
                except StateError:
                    continue  # closing: its memory goes with it
                except OSError as exc:
                    shared.host_goal = have
                    log.warning("host cache %s stays at %d host pages: %s", shared.cache_id, have, exc)
                return True
        return False
