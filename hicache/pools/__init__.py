"""KV pools: the engine's device pool and the sidecar's host mirror, sharing one geometry.

The pools (torch tensors) load when first named; the layouts do not need torch."""

from typing import TYPE_CHECKING

from hicache.pools.layouts import LAYOUTS, Layout, make_layout

if TYPE_CHECKING:
    from hicache.pools.device import DeviceKVPool
    from hicache.pools.host import HostKVPool

__all__ = ["DeviceKVPool", "HostKVPool", "LAYOUTS", "Layout", "make_layout"]


def __getattr__(name: str) -> object:
    if name == "DeviceKVPool":
        from hicache.pools.device import DeviceKVPool

        return DeviceKVPool
    if name == "HostKVPool":
        from hicache.pools.host import HostKVPool

        return HostKVPool
    raise AttributeError(f"module 'hicache.pools' has no attribute {name!r}")
