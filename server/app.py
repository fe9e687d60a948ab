"""Building and running the sidecar: create_server(config) -> (server, address), and main().
The started server is server.running_server's HiCacheServer; where it listens, server.listen."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from concurrent import futures
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hicache.memory import fd_socket_path, serve_fds
from hicache.rpc.generated import hicache_pb2 as pb
from hicache.sidecar.service import HiCacheService
from hicache.storage.factory import backend_reachable, default_file_dir, file_dir_problem

from .auth import TokenInterceptor
from .config import ServerConfig, build_parser, host_budget_problem, parse_args, requested_log_format
from .decoding import add_servicer
from .envflags import unknown_variables
from .health_monitor import NOT_SERVING, HealthMonitor
from .health_service import HealthService
from .listen import _bind, _prepare_socket
from .logs import announce, configure_logging
from .metrics import Metrics, metrics_url
from .running_server import HiCacheServer
from .servicer import HiCacheServicer
from .streams import StreamSlots

log = logging.getLogger("hicache.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["HiCache"].full_name


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


def storage_problem(backend: str, extra: Mapping[str, Any]) -> tuple[str, str]:
    """What about the storage tier stops start-up (unless it is optional), and where to fix
    it: a file tier's folder that cannot hold pages, a Mooncake master that does not answer
    (Mooncake's own set-up would wait about 90 s for it). ("", "") when nothing does."""
    if backend == "file":
        problem = file_dir_problem(extra.get("dir") or default_file_dir())
        return problem, "the folder is --hicache-storage-backend-extra-config's dir"
    if backend == "mooncake":
        reachable, why = backend_reachable(backend, extra)
        return ("", "") if reachable else (why, "master_server_address in --hicache-storage-backend-extra-config")
    return "", ""


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
    problem, where = storage_problem(h.storage_backend, h.storage_extra)
    if problem and not config.storage_optional:
        announce(
            config.log_format,
            f"error: {problem} ({where}; --hicache-storage-optional serves from host memory without it)",
            sys.stderr,
            level="ERROR",
        )
        return 2
    if problem:
        log.warning(
            "%s: the %s tier is down, serving from host memory (--hicache-storage-optional)", problem, h.storage_backend
        )
    if h.storage_backend == "file":
        cap, folder = h.extra_config.get("max_bytes"), h.extra_config.get("dir") or default_file_dir()
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
