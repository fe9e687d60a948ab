"""hicache: hierarchical KV-cache offloading for LLM inference servers."""

from hicache.geometry import BufferSpec, KVGeometry
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.transfer import TransferEngine

__all__ = ["BufferSpec", "DeviceKVPool", "HostKVPool", "KVGeometry", "TransferEngine"]
__version__ = "0.1.0"
