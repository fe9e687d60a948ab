"""The hicache sidecar process: gRPC servicer, flags and entry point.

Installed as the package `hicache_server`; `python -m server` runs it from a checkout.
"""

from .app import HiCacheServer, create_server, main
from .config import ServerConfig, parse_args

__all__ = ["HiCacheServer", "ServerConfig", "create_server", "main", "parse_args"]
