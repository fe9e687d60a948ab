"""hicache: hierarchical KV-cache offloading for LLM inference servers.

Importing hicache imports neither torch nor grpc: the pools and the transfer engine (torch)
and the client (grpc) load when first named, so that a CPU-only sidecar starts without torch.
"""

from hicache._version import __version__
from hicache.geometry import BufferSpec, KVGeometry
from hicache.keys import page_keys

__all__ = [
    "BufferSpec",
    "DeviceKVPool",
    "HiCacheClient",
    "HostKVPool",
    "KVGeometry",
    "TransferEngine",
    "__version__",
    "page_keys",
]

_LAZY = {
    "DeviceKVPool": "hicache.pools",
    "HostKVPool": "hicache.pools",
    "TransferEngine": "hicache.transfer",
    "HiCacheClient": "hicache.client",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hicache' has no attribute {name!r}")
