"""The sidecar service's configuration, results and errors (no gRPC, no torch).

Error policy (the servicer maps these to gRPC status codes, nothing else does):
- ValueError: a caller's mistake (bad page, key, geometry, batch size), naming the value.
- KeyError: an unknown pool id or operation id.
- StateError: the call is well formed but the pool cannot take it now (closing, shut down).
- NoSpace: returned, not raised, when a whole call cannot proceed for lack of memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from hicache.cache.config import HiCacheConfig
from hicache.geometry import KVGeometry
from hicache.pools.layouts import LAYOUTS

# --hicache-io-backend value -> TransferEngine backend
IO_BACKENDS: dict[str, Literal["auto", "torch", "triton"]] = {"auto": "auto", "direct": "torch", "kernel": "triton"}


class StateError(RuntimeError):
    """The pool or service is in a state that refuses the call (closing, shut down)."""


class UnknownId(KeyError):
    """A pool id or operation id the sidecar does not know (NOT_FOUND over gRPC; any other
    KeyError is an internal error)."""


class KeyStatus(enum.Enum):
    """Per-key outcome; names match hicache.v1.KeyStatus without the KEY_STATUS_ prefix."""

    STORED = "stored"  # offload: copied to host
    DEDUPLICATED = "deduplicated"  # offload: already resident
    NO_SPACE = "no_space"  # offload: no free or evictable host page
    LOADED = "loaded"  # reload: copied to the device page
    NOT_FOUND = "not_found"  # not resident in host memory
    RESIDENT = "resident"  # prefetch: already in host memory
    MISSING = "missing"  # prefetch: in no tier
    EVICTED = "evicted"
    BUSY = "busy"  # evict: pinned or being read
    PINNED = "pinned"
    UNPINNED = "unpinned"
    NOT_PINNED = "not_pinned"
    LOADED_FROM_STORAGE = "loaded_from_storage"  # reload: fetched from storage first
    FETCHING = "fetching"  # prefetch: being fetched from storage
    FETCHED = "fetched"  # prefetch: fetched from storage into host memory


class Tier(enum.Enum):
    NONE = "none"
    HOST = "host"
    STORAGE = "storage"


@dataclass(frozen=True)
class NoSpace:
    """A whole call could not proceed for lack of memory or pool slots."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """How the service sizes and guards pools.

    expected: the geometry per group ("full", "swa") the sidecar accepts, derived from the
    model config; None accepts any valid geometry. Host pool pages per registered pool:
    see HiCacheConfig.host_pages (SGLang's --hicache-size / --hicache-ratio). `hierarchy`
    also names the storage tier and the write and prefetch policies; the default here is
    host memory only (backend "none"), the server's default is the file tier.
    """

    expected: dict[str, KVGeometry] | None = None
    hierarchy: HiCacheConfig = field(default_factory=lambda: HiCacheConfig(storage_backend="none"))
    host_layout: str = "layer_first"
    lease_timeout_s: float = 30.0
    max_batch: int = 65536
    max_pools: int = 64
    request_cache_size: int = 4096
    finished_ops_kept: int = 256
    io_backend: str = "auto"  # SGLang's --hicache-io-backend: direct (torch copies), kernel (Triton), auto

    def __post_init__(self) -> None:
        if self.io_backend not in IO_BACKENDS:
            raise ValueError(f"unknown io backend {self.io_backend!r}; expected one of {list(IO_BACKENDS)}")
        if self.host_layout not in LAYOUTS:
            raise ValueError(f"unknown host layout {self.host_layout!r}; expected one of {list(LAYOUTS)}")
        if self.lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {self.lease_timeout_s}")
        for name in ("max_batch", "max_pools", "request_cache_size", "finished_ops_kept"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def host_pages_for(self, geometry: KVGeometry, device_pages: int) -> int:
        """Host pool pages for a pool of device_pages pages of `geometry` (at least 1)."""
        return self.hierarchy.host_pages(geometry, device_pages)


@dataclass(frozen=True)
class PoolInfo:
    """What RegisterPool returns."""

    pool_id: str
    host_pages: int
    host_shm_name: str
    host_layout: str
    host_nbytes: int
    geometry_fingerprint: str
    key_hash: str
    key_bytes: int
    lease_timeout_s: float


@dataclass(frozen=True)
class TransferResult:
    """Offload / Reload answer: one status per key, in request order."""

    statuses: tuple[KeyStatus, ...]
    bytes_copied: int = 0
    op_id: str = ""
    done: bool = True


@dataclass(frozen=True)
class EvictResult:
    statuses: tuple[KeyStatus, ...]
    pages_freed: int


@dataclass(frozen=True)
class LookupResult:
    prefix_length: int
    tiers: tuple[Tier, ...]


@dataclass(frozen=True)
class TierStats:
    tier: Tier
    pages: int
    bytes: int
    hits: int
    misses: int


@dataclass(frozen=True)
class PoolStats:
    pool_id: str
    group: str
    namespace: str
    model_id: str
    device_pages: int
    host_pages: int
    used_pages: int
    pinned_pages: int
    page_bytes: int
    tiers: tuple[TierStats, ...]
    offload_bytes: int
    offload_gbps: float
    reload_bytes: int
    reload_gbps: float
    ops_in_flight: int
    storage_backend: str = "none"
    storage_healthy: bool = True
    storage_write_queue: int = 0
    copy_backend: str = ""  # TransferEngine.backend: native | torch | triton


@dataclass(frozen=True)
class PrefetchOutcome:
    """Prefetch answer: per-key statuses, the op id to Watch, and how the wait ended."""

    statuses: tuple[KeyStatus, ...]
    op_id: str = ""
    done: bool = True
    timed_out: bool = False


@dataclass(frozen=True)
class OpEvent:
    """One progress event of an asynchronous operation."""

    kind: str  # "layer_done", "progress" (prefetch pages), "done" or "failed"
    layer: int = 0  # pool-local layer index, for "layer_done"
    layers_done: int = 0
    layer_num: int = 0
    error: str = ""


@dataclass
class Counters:
    """Cumulative per-pool counters (guarded by the pool's lock)."""

    host_hits: int = 0
    host_misses: int = 0
    offload_bytes: int = 0
    offload_s: float = 0.0
    reload_bytes: int = 0
    reload_s: float = 0.0
    stored: int = 0
    deduplicated: int = 0
    no_space: int = 0

    @staticmethod
    def gbps(nbytes: int, seconds: float) -> float:
        return nbytes / seconds / 1e9 if seconds > 0 else 0.0
