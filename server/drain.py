"""Shutdown without CANCELLED: the unary calls in flight are counted, and once draining
starts a new call is answered FAILED_PRECONDITION while the running ones finish.

gRPC's own stop() cancels a call that reaches the server between stop() and the listening
socket closing, and any call still running when the grace runs out; draining first leaves
it only the calls that arrive in that last instant (the client retries a CANCELLED it did
not cause, with the same request id, and then finds the sidecar gone: UNAVAILABLE)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from hicache.sidecar.errors import StateError

SHUTTING_DOWN = "the sidecar is shutting down"


class Drain:
    """Thread-safe count of the calls in flight, and the switch that refuses new ones."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self.draining = False

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Around one call. Raises StateError (FAILED_PRECONDITION) once draining."""
        with self._cond:
            if self.draining:
                raise StateError(SHUTTING_DOWN)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                if not self._running:
                    self._cond.notify_all()

    def start(self, timeout: float) -> float:
        """Refuse new calls and wait up to `timeout` s for the running ones; returns the time
        left of `timeout`."""
        end = time.monotonic() + timeout
        with self._cond:
            self.draining = True
            self._cond.wait_for(lambda: self._running == 0, timeout=timeout)
        return max(0.0, end - time.monotonic())
