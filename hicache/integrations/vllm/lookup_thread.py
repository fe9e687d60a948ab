"""LookupThread: the vLLM manager's one thread for sidecar calls, off the scheduler thread.

The manager runs its Lookups, Pins and Unpins here (rank_pools), and a timer queues a sweep
of expired answers here even when vLLM runs no step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class LookupThread:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hicache-lookup")
        self._timer: threading.Timer | None = None

    def submit(self, fn: Any, *args: Any) -> Future[None] | None:
        """fn(*args) on the lookup thread; None once shut down."""
        try:
            return self._executor.submit(fn, *args)
        except RuntimeError:  # shut down
            return None

    def arm(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Submit fn() in delay_s seconds, unless a timer is running already."""
        if self._timer is not None and self._timer.is_alive():
            return
        self._timer = threading.Timer(delay_s, self.submit, (fn,))
        self._timer.daemon = True
        self._timer.start()

    def shutdown(self) -> None:
        """Cancel the timer, drop the calls not started and wait for the running one."""
        if self._timer is not None:
            self._timer.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
