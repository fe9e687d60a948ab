"""The engine side of the socket: HiCacheClient, what an inference server embeds to drive the
sidecar, with its reload handles, errors and TLS settings, and the health and stats clients
behind the `hicache` command."""

from hicache.client.client import HiCacheClient, RegisteredPool
from hicache.client.handles import HiCacheRpcError, ReloadHandle, ReloadOutcomeUnknown
from hicache.client.tls import ClientTls
from hicache.keys import page_keys

__all__ = [
    "ClientTls",
    "HiCacheClient",
    "HiCacheRpcError",
    "RegisteredPool",
    "ReloadHandle",
    "ReloadOutcomeUnknown",
    "page_keys",
]
