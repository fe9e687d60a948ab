"""Building and running the sidecar: create_server(config) -> (server, address), and main()."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hicache.memory import fd_socket_path, serve_fds
from hicache.memory.fd import FdListener
from hicache.rpc.generated import hicache_pb2 as pb
from hicache.sidecar.service import HiCacheService
from hicache.storage.factory import default_file_dir, file_dir_problem

from .auth import TokenInterceptor
from .config import ServerConfig, build_parser, host_budget_problem, parse_args, requested_log_format
from .decoding import add_servicer
from .drain import Drain
from .envflags import unknown_variables
from .health_monitor import NOT_SERVING, HealthMonitor
from .logs import announce, configure_logging
from .metrics import Metrics, metrics_url
from .servicer import HiCacheServicer
from .streams import StreamSlots

log = logging.getLogger("hicache.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["HiCache"].full_name


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


def _prepare_socket(path: str) -> None:
    """Create the socket's directory (0700 when we make it) and remove a stale socket file.

    Raises ValueError if another user could replace the socket (the folder belongs to
    someone else, or others may write in it without the sticky bit), if `path` exists and
    is not a socket, or if a live server already listens on it.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid not in (os.getuid(), 0):
        raise ValueError(f"socket folder {directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ValueError(f"socket folder {directory} is writable by others (mode {oct(st.st_mode & 0o777)})")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: nobody listens
        return
    finally:
        probe.close()
    raise ValueError(f"a server already listens on {path}")


def tls_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """Server credentials from --tls-cert/--tls-key (and --tls-client-ca for mTLS), or None."""
    if not config.tls_cert or not config.tls_key:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    client_ca = read(config.tls_client_ca) if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read(config.tls_key), read(config.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


class HealthService(health.HealthServicer):
    """grpc's health service with end_watches(): on shutdown it ends every open Watch stream
    (after its last answer, NOT_SERVING), which would otherwise hold the server all its grace."""

    def __init__(self) -> None:
        super().__init__()
        self._watches_lock = threading.Lock()
        self._watches: set[Callable[[], None]] = set()
        self._ending = False

    def Watch(self, request: Any, context: grpc.ServicerContext, send_response_callback: Any = None) -> Any:
        stream = super().Watch(request, context, send_response_callback)
        # the blocking form returns its stream; the other one ends when sent None
        end = stream.close if stream is not None else functools.partial(send_response_callback, None)
        with self._watches_lock:
            if not self._ending:
                self._watches.add(end)
                context.add_callback(functools.partial(self._forget, end))
                return stream
        end()  # a Watch that came while shutting down
        return stream

    def _forget(self, end: Callable[[], None]) -> None:
        with self._watches_lock:
            self._watches.discard(end)

    def end_watches(self) -> None:
        with self._watches_lock:
            self._ending = True
            ends, self._watches = list(self._watches), set()
        for end in ends:
            end()


def _bind(server: grpc.Server, config: ServerConfig, address: str) -> list[str]:
    """Add the socket's and --listen's ports; returns the addresses. Raises ValueError naming an
    address that cannot be bound."""
    try:
        server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises this, not OSError, for an address it cannot bind
        raise ValueError(f"cannot listen on {address}") from None
    if not config.listen:
        return [address]
    creds = tls_credentials(config)
    try:
        port = server.add_secure_port(config.listen, creds) if creds else server.add_insecure_port(config.listen)
    except RuntimeError:
        port = 0
    if port == 0:
        raise ValueError(f"cannot listen on {config.listen}: the port is taken or the host is not an address here")
    return [address, f"{config.listen.rpartition(':')[0]}:{port}"]


def create_server(config: ServerConfig, service: HiCacheService | None = None) -> tuple[HiCacheServer, str]:
    """Start a sidecar on config.socket (mode 0600) and, when given, config.listen.

    Returns (server, address) where address is the "unix://" target of the socket.
    Raises ValueError for a socket already in use, or a TCP address or metrics port that
    cannot be bound (leaving no socket file behind).
    """
    service = service or HiCacheService(
        dataclasses.replace(config.service, storage_optional=config.storage_optional or config.service.storage_optional)
    )
    metrics = Metrics(service) if config.metrics_port is not None else None
    interceptors: list[grpc.ServerInterceptor] = [metrics.interceptor] if metrics is not None else []
    if config.token:
        interceptors.append(TokenInterceptor(config.token))
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    executor = futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="hicache-rpc")
    server = grpc.server(executor, interceptors=interceptors, options=options)
    streams = StreamSlots(config.max_streams, config.max_event_streams)
    servicer = HiCacheServicer(service, config.admin_token, streams)
    add_servicer(servicer, server)  # undecodable requests: INVALID_ARGUMENT
    health_servicer = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    for name in ("", SERVICE_NAME):  # until the first storage check has answered
        health_servicer.set(name, NOT_SERVING)

    _prepare_socket(config.socket)
    address = f"unix://{os.path.abspath(config.socket)}"
    monitor: HealthMonitor | None = None

    def undo() -> None:
        if monitor is not None:
            monitor.stop()
        server.stop(None).wait()
        executor.shutdown(wait=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.socket)  # ours: _prepare_socket removed any stale one

    old_umask = os.umask(0o177)  # the socket is created 0600: only this user may connect
    try:
        addresses = _bind(server, config, address)
        server.start()
    except BaseException:
        undo()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(config.socket, 0o600)
    check = service.healthy if not config.storage_optional else service.degraded_but_serving
    monitor = HealthMonitor(check, health_servicer, ("", SERVICE_NAME), config.health_interval_s)
    metrics_port = None
    if metrics is not None:
        try:
            metrics_port = metrics.serve(config.metrics_port or 0, config.metrics_host)
        except OSError as exc:
            undo()
            raise ValueError(f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {exc}") from None
    log.info("hicache sidecar listening on %s", ", ".join(addresses))
    hs = HiCacheServer(
        config,
        server,
        service,
        addresses,
        monitor=monitor,
        metrics=metrics,
        metrics_port=metrics_port,
        executor=executor,
        end_streams=(servicer.end_streams, health_servicer.end_watches),
        drain=servicer.drain,
    )
    try:
        hs.fd_listener = serve_fds(fd_socket_path(config.socket), service.fds)
    except OSError as exc:  # engines that share memory by name still work
        log.warning("cannot take engines' fds on %s: %s", fd_socket_path(config.socket), exc)
    return hs, address


def main(argv: list[str] | None = None) -> int:
    """`hicache-server` / `python -m server`: run until SIGTERM or SIGINT, then shut down gracefully."""
    try:
        config, level = parse_args(argv)
    except (ValueError, OSError) as exc:
        announce(requested_log_format(argv), f"error: {exc}", sys.stderr, level="ERROR")
        return 2
    try:
        configure_logging(level, config.log_format)
    except ValueError as exc:
        announce(config.log_format, f"error: {exc}", sys.stderr, level="ERROR")
        return 2
    h = config.service.hierarchy
    budget_problem = host_budget_problem(h.size_gb)
    if budget_problem:
        announce(config.log_format, f"error: {budget_problem}", sys.stderr, level="ERROR")
        return 2
    if h.storage_backend == "file":
        cap = h.extra_config.get("max_bytes")
        folder = h.extra_config.get("dir") or default_file_dir()
        problem = file_dir_problem(folder)
        if problem and not config.storage_optional:
            announce(
                config.log_format,
                f"error: {problem} (the folder is --hicache-storage-backend-extra-config's dir; "
                "--hicache-storage-optional serves from host memory without it)",
                sys.stderr,
                level="ERROR",
            )
            return 2
        if problem:
            log.warning("%s: the file tier is down, serving from host memory (--hicache-storage-optional)", problem)
        log.info("file tier under %s: at most %s bytes of pages per model (max_bytes in the extra config)", folder, cap)
    stray = unknown_variables(build_parser(), os.environ)
    if stray:
        log.warning("ignoring environment variables that name no flag: %s", ", ".join(stray))
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    # before the first call can arrive: pools made on its threads rely on this handler
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server, address = create_server(config)
    except (ValueError, OSError) as exc:
        announce(config.log_format, f"error: {exc}", sys.stderr, level="ERROR")
        return 2
    metrics = None if server.metrics_port is None else metrics_url(config.metrics_host, server.metrics_port)
    announce(
        config.log_format,
        f"serving on {' '.join(server.addresses)}" + (f"; metrics on {metrics}" if metrics else ""),
        sys.stdout,
        addresses=server.addresses,
        metrics=metrics,
    )
    while not stop.wait(0.5):
        pass
    server.stop()
    log.info("stopped")
    return 0
