"""How the sidecar service sizes and guards its pools."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hicache.cache.config import HiCacheConfig
from hicache.geometry import KVGeometry
from hicache.pools.layouts import LAYOUTS
from hicache.transfer.native import LAYERED_INLINE_BYTES

# the longest duration a flag may give: finite, and within what threading and protobuf accept
MAX_SECONDS = 1e9


def check_seconds(flag: str, value: float, *, zero_ok: bool = False) -> None:
    """Raises ValueError naming `flag` unless `value` is a finite number of seconds above 0
    (or 0, with zero_ok) and at most MAX_SECONDS."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= 0 if zero_ok else value > 0) and value <= MAX_SECONDS
    if not ok:
        low = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{flag} must be a finite number of seconds {low} and <= 1e9, got {value!r}")


# --hicache-io-backend value -> TransferEngine backend
IO_BACKENDS: dict[str, Literal["auto", "torch", "triton"]] = {"auto": "auto", "direct": "torch", "kernel": "triton"}


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """How the service sizes and guards pools.

    expected: the geometry per group ("full", "swa") the sidecar accepts, derived from the
    model config; None accepts any valid geometry. Host pool pages per registered pool:
    ratio x device pages, or with hierarchy.size_gb a share of that budget for the whole
    sidecar (hicache.sidecar.host_budget). `hierarchy`
    also names the storage tier and the write and prefetch policies; the default here is
    host memory only (backend "none"), the server's default is the file tier.
    """

    expected: dict[str, KVGeometry] | None = None
    hierarchy: HiCacheConfig = field(default_factory=lambda: HiCacheConfig(storage_backend="none"))
    host_layout: str = "layer_first"
    lease_timeout_s: float = 30.0
    max_batch: int = 65536
    max_pools: int = 64
    max_pools_per_namespace: int = 32  # one tenant (or one careless engine) cannot take every slot
    max_pin_share: float = 0.5  # the share of its host cache's pages one pool may pin (--max-pin-share)
    request_cache_size: int = 4096
    finished_ops_kept: int = 256
    io_backend: str = "auto"  # SGLang's --hicache-io-backend: direct (torch copies), kernel (Triton), auto
    # a layer-wise reload of fewer bytes is copied before the answer (done), on CPU pools:
    # cheaper than its worker thread and the engine's layer waits (0: always layer by layer);
    # by default the size the engine itself copies in the calling thread
    layerwise_inline_bytes: int = LAYERED_INLINE_BYTES
    # a storage tier that cannot be made for a pool (its folder read-only) is reported down
    # and host memory serves, instead of the registration failing (--hicache-storage-optional)
    storage_optional: bool = False

    def __post_init__(self) -> None:
        if self.io_backend not in IO_BACKENDS:
            raise ValueError(f"unknown io backend {self.io_backend!r}; expected one of {list(IO_BACKENDS)}")
        if self.host_layout not in LAYOUTS:
            raise ValueError(f"unknown host layout {self.host_layout!r}; expected one of {list(LAYOUTS)}")
        check_seconds("--lease-timeout", self.lease_timeout_s)
        for name in ("max_batch", "max_pools", "max_pools_per_namespace", "request_cache_size", "finished_ops_kept"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.max_pin_share <= 1:
            raise ValueError(f"--max-pin-share must be in (0, 1], got {self.max_pin_share!r}")
        if self.layerwise_inline_bytes < 0:
            raise ValueError(f"layerwise_inline_bytes must be >= 0, got {self.layerwise_inline_bytes}")

    def host_pages_for(self, geometry: KVGeometry, device_pages: int) -> int:
        """Host pool pages for a pool of device_pages pages of `geometry` (at least 1)."""
        return self.hierarchy.host_pages(geometry, device_pages)
