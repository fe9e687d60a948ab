"""Keeps the gRPC health service honest: NOT_SERVING while a required tier is down."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from grpc_health.v1 import health, health_pb2

from hicache.sidecar.config import check_seconds

log = logging.getLogger("hicache.server")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthMonitor:
    """Every interval_s, calls check() -> (ok, why) and sets `services` SERVING or NOT_SERVING."""

    def __init__(
        self,
        check: Callable[[], tuple[bool, str]],
        servicer: health.HealthServicer,
        services: Sequence[str],
        interval_s: float,
    ):
        check_seconds("--health-interval", interval_s)
        self._check, self._servicer, self._services = check, servicer, list(services)
        self._stop = threading.Event()
        self.serving = True
        self.poll()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="hicache-health", daemon=True)
        self._thread.start()

    def poll(self) -> bool:
        """Check now and publish the result; returns whether the sidecar is serving."""
        try:
            ok, why = self._check()
        except Exception as exc:
            ok, why = False, f"health check failed: {type(exc).__name__}: {exc}"
        if ok != self.serving:
            if ok:
                log.info("healthy again: SERVING")
            else:
                log.warning("NOT_SERVING: %s", why)
        self.serving = ok
        for name in self._services:
            self._servicer.set(name, SERVING if ok else NOT_SERVING)
        return ok

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.poll()

    def stop(self) -> None:
        """Stop polling and report NOT_SERVING (the server is going away)."""
        self._stop.set()
        self._thread.join()
        for name in self._services:
            self._servicer.set(name, NOT_SERVING)
