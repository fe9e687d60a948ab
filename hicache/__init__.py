"""hicache: hierarchical KV-cache offloading for LLM inference servers."""

from hicache.geometry import BufferSpec, KVGeometry
from hicache.keys import page_keys
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.transfer import TransferEngine

__all__ = ["BufferSpec", "DeviceKVPool", "HiCacheClient", "HostKVPool", "KVGeometry", "TransferEngine", "page_keys"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name == "HiCacheClient":  # lazy: importing hicache must not import grpc
        from hicache.client import HiCacheClient

        return HiCacheClient
    raise AttributeError(f"module 'hicache' has no attribute {name!r}")
