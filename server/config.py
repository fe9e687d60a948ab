"""Command-line flags of `hicache-server` and the ServerConfig they build."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from hicache.cache.config import HiCacheConfig
from hicache.geometry import KVGeometry
from hicache.hf_config import model_geometries
from hicache.pools.layouts import LAYOUTS
from hicache.service_types import ServiceConfig


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/hicache/hicache.sock, else /tmp/hicache-$UID/hicache.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "hicache", "hicache.sock")
    return os.path.join(f"/tmp/hicache-{os.getuid()}", "hicache.sock")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything create_server() needs. `socket` is always served; `listen` adds TCP."""

    socket: str = field(default_factory=default_socket_path)
    listen: str | None = None
    token: str | None = None
    insecure: bool = False
    service: ServiceConfig = field(default_factory=ServiceConfig)
    grace_s: float = 10.0
    workers: int = 16
    max_message_bytes: int = 64 << 20
    reap_interval_s: float | None = None  # default: min(1, lease_timeout / 4)

    def __post_init__(self) -> None:
        if not self.socket:
            raise ValueError("socket path must be non-empty")
        if self.listen is not None:
            host, sep, port = self.listen.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ValueError(f"--listen must be HOST:PORT, got {self.listen!r}")
            if not self.token and not self.insecure:
                raise ValueError(f"--listen {self.listen} without --token: pass a token, or --insecure to allow it")
        if self.token is not None and not self.token:
            raise ValueError("token must be non-empty")
        if self.grace_s < 0 or self.workers < 1:
            raise ValueError(f"grace_s must be >= 0 and workers >= 1, got {self.grace_s} and {self.workers}")


def expected_geometries(model_config: str, *, tp_size: int, page_size: int, dtype: str) -> dict[str, KVGeometry]:
    """The geometry of every KV group of the model in an HF config.json. Raises ValueError, OSError."""
    with open(model_config) as f:
        config = json.load(f)
    return model_geometries(config, tp_size=tp_size, page_size=page_size, dtype=dtype)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hicache-server", description="hicache sidecar: host KV-cache tier over gRPC")
    p.add_argument("--socket", default=None, help=f"Unix socket path (default {default_socket_path()})")
    p.add_argument(
        "--listen", default=None, metavar="HOST:PORT", help="also listen on TCP (needs --token or --insecure)"
    )
    p.add_argument("--token", default=os.environ.get("HICACHE_TOKEN"), help="shared token (default $HICACHE_TOKEN)")
    p.add_argument("--insecure", action="store_true", help="allow --listen without a token")
    p.add_argument("--model-config", default=None, help="HF config.json; engines must register its geometry")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), bfloat16, fp8_e4m3, ...")
    p.add_argument("--hicache-mem-layout", default="layer_first", choices=LAYOUTS)
    HiCacheConfig.add_arguments(p)
    p.add_argument(
        "--lease-timeout", type=float, default=30.0, help="seconds before a silent client's pool is reclaimed"
    )
    p.add_argument("--max-batch", type=int, default=65536, help="most keys in one call")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on shutdown")
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[ServerConfig, str]:
    """(config, log level) from the command line. Raises ValueError or OSError for bad values."""
    args = build_parser().parse_args(argv)
    expected = None
    if args.model_config:
        expected = expected_geometries(
            args.model_config, tp_size=args.tp_size, page_size=args.page_size, dtype=args.kv_cache_dtype
        )
    service = ServiceConfig(
        expected=expected,
        hierarchy=HiCacheConfig.from_args(args),
        host_layout=args.hicache_mem_layout,
        lease_timeout_s=args.lease_timeout,
        max_batch=args.max_batch,
    )
    config = ServerConfig(
        socket=args.socket or default_socket_path(),
        listen=args.listen,
        token=args.token,
        insecure=args.insecure,
        service=service,
        grace_s=args.grace,
    )
    return config, args.log_level
