"""Command-line flags of `hicache-server` and the ServerConfig they build."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NoReturn

from hicache._version import __version__
from hicache.cache.config import HiCacheConfig
from hicache.geometry import KVGeometry, model_geometries, normalize_dtype
from hicache.memory import cuda_available, shm_dir
from hicache.paths import default_socket_path
from hicache.pools.layouts import LAYOUTS
from hicache.sidecar.config import IO_BACKENDS, ServiceConfig, check_seconds
from hicache.storage.factory import check_backend_kind
from hicache.validate import is_int

from .envflags import document, env_argv, env_name
from .logs import LOG_FORMATS, log_level

__all__ = ["ServerConfig", "build_parser", "default_socket_path", "parse_args", "requested_log_format"]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything create_server() needs. `socket` is always served; `listen` adds TCP."""

    socket: str = field(default_factory=default_socket_path)
    listen: str | None = None
    token: str | None = None
    admin_token: str | None = None  # stats of all pools (every pool's id and namespace) need it
    insecure: bool = False
    service: ServiceConfig = field(default_factory=ServiceConfig)
    grace_s: float = 10.0
    workers: int = 16
    max_message_bytes: int = 64 << 20
    reap_interval_s: float | None = None  # default: min(1, lease_timeout / 4)
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off, 0: any free port
    metrics_host: str = "127.0.0.1"  # loopback unless asked: a container sets 0.0.0.0
    health_interval_s: float = 5.0  # how often the storage tiers' health is checked
    storage_optional: bool = False  # stay SERVING (degraded) while a storage tier is down
    log_format: str = "text"
    tls_cert: str | None = None  # PEM certificate chain for --listen (TLS)
    tls_key: str | None = None  # its PEM private key
    tls_client_ca: str | None = None  # PEM CA bundle: clients must present a certificate it signed (mTLS)

    def __post_init__(self) -> None:
        if not self.socket:
            raise ValueError("socket path must be non-empty")
        if self.listen is not None:
            host, sep, port = self.listen.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ValueError(f"--listen must be HOST:PORT, got {self.listen!r}")
            if not self.token and not self.insecure and not self.tls_client_ca:
                raise ValueError(
                    f"--listen {self.listen} without --token: pass a token (or --tls-client-ca), or --insecure to allow it"
                )
        check_tls(self.listen, self.tls_cert, self.tls_key, self.tls_client_ca)
        if self.token is not None and not self.token:
            raise ValueError("token must be non-empty")
        if self.admin_token is not None and not self.admin_token:
            raise ValueError("admin token must be non-empty")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        check_seconds("--health-interval", self.health_interval_s)
        check_seconds("--grace", self.grace_s, zero_ok=True)
        if self.reap_interval_s is not None:
            check_seconds("reap_interval_s", self.reap_interval_s)
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if not is_int(self.workers) or self.workers < 2:  # one open stream would hold the only one
            raise ValueError(f"--workers must be an int >= 2, got {self.workers!r}")

    @property
    def max_event_streams(self) -> int:
        """KV-event streams served at once: each holds an RPC thread for as long as it is
        open, so they may take half of the workers (server/streams.py)."""
        return self.workers // 2

    @property
    def max_streams(self) -> int:
        """Streams of every kind (KV events, an operation's Watch) served at once: all the
        workers but a quarter (at least one), which unary calls and health checks keep."""
        return self.workers - max(1, self.workers // 4)


def check_tls(listen: str | None, cert: str | None, key: str | None, client_ca: str | None) -> None:
    """Raises ValueError for TLS options without --listen, a cert without its key (or the
    reverse), --tls-client-ca without a cert, or a file that cannot be read."""
    given = {n: v for n, v in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", client_ca)) if v}
    if not given:
        return
    if listen is None:
        raise ValueError(f"{', '.join(given)} need --listen: the Unix socket is local and needs no TLS")
    if bool(cert) != bool(key):
        raise ValueError(f"--tls-cert and --tls-key go together, got only {next(iter(given))}")
    if client_ca and not cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    for flag, path in given.items():
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ValueError(f"{flag} {path!r} is not a readable file")


def expected_geometries(model_config: str, *, tp_size: int, page_size: int, dtype: str) -> dict[str, KVGeometry]:
    """The geometry of every KV group of the model in an HF config.json. Raises ValueError, OSError."""
    try:
        with open(model_config) as f:
            config = json.load(f)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"model config {model_config!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"model config {model_config!r} is not a JSON object")
    return model_geometries(config, tp_size=tp_size, page_size=page_size, dtype=dtype)


class _Parser(argparse.ArgumentParser):
    """Raises ValueError for a bad command line, so that main() reports it as every other
    start-up error (one line, in the --log-format asked for) instead of argparse's usage text."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="hicache-server",
        description="hicache sidecar: host KV-cache tier over gRPC",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--socket", default=None, help=f"Unix socket path (default {default_socket_path()})")
    p.add_argument(
        "--listen", default=None, metavar="HOST:PORT", help="also listen on TCP (needs --token or --insecure)"
    )
    p.add_argument("--token", default=None, help="shared token callers must send")
    p.add_argument(
        "--admin-token",
        default=None,
        help="token for stats of all pools (hicache stats); without it only a pool's owner sees it",
    )
    p.add_argument("--insecure", action="store_true", help="allow --listen without a token")
    p.add_argument("--model-config", default=None, help="HF config.json; engines must register its geometry")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size: KV heads per rank follow it")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page, as the engine's")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), bfloat16, fp8_e4m3, ...")
    p.add_argument(
        "--hicache-mem-layout", default="layer_first", choices=LAYOUTS, help="host pool layout (SGLang names)"
    )
    p.add_argument(
        "--hicache-io-backend",
        default="auto",
        choices=list(IO_BACKENDS),
        help="device<->host copies: direct (torch copies), kernel (Triton kernels), "
        "auto (kernel on CUDA, the compiled C copies on CPU)",
    )
    HiCacheConfig.add_arguments(p)
    p.add_argument(
        "--lease-timeout", type=float, default=30.0, help="seconds before a silent client's pool is reclaimed"
    )
    p.add_argument("--max-batch", type=int, default=65536, help="most keys in one call")
    p.add_argument("--max-pools", type=int, default=64, help="most pools registered at once")
    p.add_argument(
        "--max-pools-per-namespace",
        type=int,
        default=32,
        help="most pools of one namespace (RegisterPool's namespace) at once: one tenant cannot take every slot",
    )
    p.add_argument("--max-pin-share", type=float, default=0.5, help="share of its host cache one pool may pin")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on shutdown")
    p.add_argument(
        "--workers",
        type=int,
        default=16,
        help="RPC threads; KV-event streams may hold half of them, streams in all (with Watch) all but a quarter",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS, help="text, or json: one object a line")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (default off)"
    )
    p.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (0.0.0.0: every interface)"
    )
    p.add_argument("--health-interval", type=float, default=5.0, help="seconds between storage tier health checks")
    p.add_argument(
        "--hicache-storage-optional",
        action="store_true",
        help="keep gRPC health SERVING while the storage tier is down (host memory still serves; "
        "stats, metrics and logs report the tier); default: the tier is required, NOT_SERVING",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve --listen over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA bundle: require client certificates it signed (mTLS)")
    return document(p)


def check_start_up(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """What can be refused before the first registration. Raises ValueError."""
    if args.page_size < 1:
        raise ValueError(f"--page-size must be >= 1 (tokens per KV page, as the engine's), got {args.page_size}")
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.kv_cache_dtype != "auto":  # checked with or without --model-config: a typo is never ignored
        try:
            normalize_dtype(args.kv_cache_dtype)
        except ValueError as exc:
            raise ValueError(f"--kv-cache-dtype: {exc}") from None
    if args.socket == "":
        raise ValueError(f"--socket must be a path, got '' (leave it out for {default_socket_path()})")
    if args.hicache_io_backend == "kernel" and env.get("TRITON_INTERPRET") != "1" and not cuda_available():
        raise ValueError(
            "--hicache-io-backend kernel runs Triton copy kernels on CUDA, and this sidecar has no GPU: "
            "use auto or direct (or TRITON_INTERPRET=1 to run the kernels interpreted, for tests)"
        )


def host_budget_problem(size_gb: float) -> str:
    """Why this machine cannot hold a --hicache-size of size_gb ("" if it can): host pools
    live in /dev/shm. Checked when the sidecar starts, not when flags are parsed (a compose
    file's flags are valid on a machine with a smaller /dev/shm)."""
    total = shutil.disk_usage(shm_dir()).total
    if size_gb * 1e9 <= total:
        return ""
    return (
        f"--hicache-size {size_gb:g} GB is more than {shm_dir()} can hold ({total / 1e9:.2f} GB): "
        "host pools live there (grow it, e.g. docker's --shm-size, or ask for less)"
    )


def requested_log_format(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The --log-format asked for (the command line's, else HICACHE_LOG_FORMAT), or "text"
    when it names none: how to print an error in the other flags, which parse_args refused."""
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("--log-format", default=env.get(env_name("--log-format"), "text"))
    try:
        fmt = p.parse_known_args(sys.argv[1:] if argv is None else list(argv))[0].log_format
    except argparse.ArgumentError:
        return "text"
    return fmt if fmt in LOG_FORMATS else "text"


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> tuple[ServerConfig, str]:
    """(config, log level) from the command line (default sys.argv[1:]) and the HICACHE_*
    variables of `environ` (default os.environ; see envflags). Raises ValueError or OSError."""
    parser = build_parser()
    env = os.environ if environ is None else environ
    args = parser.parse_args(env_argv(parser, env) + (sys.argv[1:] if argv is None else list(argv)))
    check_start_up(args, env)
    variable = env_name("--log-level")
    if variable in env:  # named as the user set it: the command line may not mention --log-level
        log_level(env[variable], variable)
    log_level(args.log_level)
    expected = None
    if args.model_config:
        expected = expected_geometries(
            args.model_config, tp_size=args.tp_size, page_size=args.page_size, dtype=args.kv_cache_dtype
        )
    hierarchy = HiCacheConfig.from_args(args).with_file_cap()
    check_backend_kind(hierarchy.storage_backend, hierarchy.storage_extra)
    service = ServiceConfig(
        expected=expected,
        hierarchy=hierarchy,
        host_layout=args.hicache_mem_layout,
        io_backend=args.hicache_io_backend,
        lease_timeout_s=args.lease_timeout,
        max_batch=args.max_batch,
        max_pools=args.max_pools,
        max_pools_per_namespace=args.max_pools_per_namespace,
        max_pin_share=args.max_pin_share,
    )
    config = ServerConfig(
        socket=args.socket or default_socket_path(),
        listen=args.listen,
        token=args.token,
        admin_token=args.admin_token,
        insecure=args.insecure,
        service=service,
        grace_s=args.grace,
        workers=args.workers,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        health_interval_s=args.health_interval,
        storage_optional=args.hicache_storage_optional,
        log_format=args.log_format,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
    )
    return config, args.log_level
