"""HiCacheServer: a started sidecar (the gRPC server, the service, the reaper of expired
leases and unclaimed fds) and its graceful stop."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc

from hicache.memory import fd_socket_path
from hicache.memory.fd import FdListener
from hicache.sidecar.service import HiCacheService

from .config import ServerConfig
from .drain import Drain
from .health_monitor import HealthMonitor
from .metrics import Metrics

log = logging.getLogger("hicache.server")


class HiCacheServer:
    """A started sidecar: the gRPC server, the service, and the reaper of expired leases and
    unclaimed fds."""

    def __init__(
        self,
        config: ServerConfig,
        grpc_server: grpc.Server,
        service: HiCacheService,
        addresses: list[str],
        *,
        monitor: HealthMonitor | None = None,
        metrics: Metrics | None = None,
        metrics_port: int | None = None,
        executor: futures.ThreadPoolExecutor | None = None,
        end_streams: Sequence[Callable[[], None]] = (),
        drain: Drain | None = None,
    ):
        self.config = config
        self.grpc = grpc_server
        self.service = service
        self.addresses = addresses
        self.monitor = monitor
        self.metrics = metrics
        self.metrics_port = metrics_port  # the bound port of /metrics, when served
        self.fd_listener: FdListener | None = None  # engines' fds (memfd pools), beside the socket
        self._executor = executor  # the RPC threads: shut down with the server
        self._end_streams = end_streams  # end the open streams (events, health Watch) cleanly
        self.drain = drain  # the servicer's unary calls: finished before gRPC stops
        self._stopped = threading.Event()
        interval = config.reap_interval_s or min(1.0, config.service.lease_timeout_s / 4)
        self._reaper = threading.Thread(target=self._reap, args=(interval,), name="hicache-reaper", daemon=True)
        self._reaper.start()

    def _reap(self, interval: float) -> None:
        """Release the pools whose lease ran out, every `interval` s. A lease measures the
        engine's silence, not the sidecar's: a tick that comes late by more than an interval
        (and a second) means this process was not running (SIGSTOP, CPU starvation, a paused
        VM) while renewals queued up, so every lease is extended by that time and this tick
        reaps nothing, leaving the queued KeepAlives to be read first."""
        last = time.monotonic()
        while not self._stopped.wait(interval):
            now = time.monotonic()
            stalled, last = now - last - interval, now
            if stalled > interval + 1.0:
                self.service.extend_leases(stalled)
                log.warning("the sidecar did not run for %.1f s: every lease is extended by that time", stalled)
                continue
            for pool_id in self.service.reap_expired():
                log.warning("lease expired: released pool %s", pool_id)
            closed = self.service.fds.expire()  # an engine that sent fds and died before registering
            if closed:
                log.warning("closed %d fds that no registration claimed in time", closed)

    def stop(self, grace: float | None = None) -> None:
        """Stop taking calls (a new one is answered FAILED_PRECONDITION while the running ones
        finish: server.drain), then stop gRPC, end the open streams (KV events, health Watch:
        each ends cleanly after what it has queued), all within `grace` s, release every
        pool (in-flight transfers finish, shared memory is unlinked), join the server's threads
        and remove the socket. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.monitor is not None:
            self.monitor.stop()
        grace = self.config.grace_s if grace is None else grace
        if self.drain is not None:
            grace = self.drain.start(grace)
        stopped = self.grpc.stop(grace)
        for end in self._end_streams:  # streams without end would hold the whole grace, then fail
            end()
        stopped.wait()
        self.service.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.metrics is not None:
            self.metrics.stop()
        self._reaper.join()
        if self.fd_listener is not None:
            self.fd_listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fd_socket_path(self.config.socket))
        self.service.fds.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.config.socket)

    def wait(self) -> None:
        self.grpc.wait_for_termination()
