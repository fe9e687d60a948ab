"""hicache: hierarchical KV-cache offloading for LLM inference servers."""

from hicache._version import __version__
from hicache.geometry import BufferSpec, KVGeometry
from hicache.keys import page_keys
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.transfer import TransferEngine

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


def __getattr__(name: str) -> object:
    if name == "HiCacheClient":  # lazy: importing hicache must not import grpc
        from hicache.client import HiCacheClient

        return HiCacheClient
    raise AttributeError(f"module 'hicache' has no attribute {name!r}")
