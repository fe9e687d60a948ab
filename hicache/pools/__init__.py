"""KV pools: the engine's device pool and the sidecar's host mirror, sharing one geometry."""

from hicache.pools.device import DeviceKVPool
from hicache.pools.host import HostKVPool
from hicache.pools.layouts import LAYOUTS, Layout, make_layout

__all__ = ["DeviceKVPool", "HostKVPool", "LAYOUTS", "Layout", "make_layout"]
