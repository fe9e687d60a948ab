"""The service's vocabulary, shared by both sides of the socket: per-key statuses, tiers,
and the results and stats the sidecar answers and the client hands to the engine.
Plain dataclasses and enums: no gRPC, no torch (hicache.rpc.convert maps them to protobuf).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# call metadata: a pool's secret (every call naming the pool), the admin token (all-pool stats)
POOL_SECRET = "x-hicache-pool-secret"
ADMIN_TOKEN = "x-hicache-admin-token"


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
    pool_secret: str = ""  # required (as call metadata) by every later call naming the pool
    progress_shm_name: str = ""  # the pool's progress block (layer-wise reloads), "" for none
    progress_nbytes: int = 0
    # CUDA pools: the layer events' IPC handles (layer_event_slots x layer_num, slot-major)
    layer_event_handles: tuple[bytes, ...] = ()
    layer_event_slots: int = 0
    # the copy window an engine copying itself (BeginCopy) offloads into (see sidecar.grants)
    window_shm_name: str = ""
    window_pages: int = 0


@dataclass(frozen=True)
class CopyGrant:
    """BeginCopy answer (copy path "engine": the engine copies itself). statuses: one per key
    (offload: STORED granted, DEDUPLICATED, NO_SPACE; reload: LOADED / LOADED_FROM_STORAGE
    granted, NOT_FOUND). host_pages: for a reload, the host page of each granted key; for an
    offload, the copy window's page each granted key is written into; in key order.
    EndCopy(grant_id) within expires_s seconds (a later one is reported, the pages stay
    held); grant_id "" when nothing was granted."""

    statuses: tuple[KeyStatus, ...]
    host_pages: tuple[int, ...]
    grant_id: str
    expires_s: float


@dataclass(frozen=True)
class TransferResult:
    """Offload / Reload answer: one status per key, in request order."""

    statuses: tuple[KeyStatus, ...]
    bytes_copied: int = 0
    op_id: str = ""
    done: bool = True
    # a layer-wise reload's slot in the pool's progress block (PoolInfo.progress_shm_name):
    # its generation and how many progress words it uses (0: none, follow Watch)
    progress_slot: int = 0
    progress_generation: int = 0
    progress_words: int = 0
    # a layer-wise reload on CUDA: the slot of the pool's layer events it recorded, and how
    # many (0: none, follow Watch)
    event_slot: int = 0
    event_layers: int = 0


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
    capacity_bytes: int = 0  # the tier's size cap; 0: none known


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
    storage_nodes_down: tuple[str, ...] = ()  # Redis servers / cluster nodes down now (host:port)
    write_policy: str = ""  # write_through | write_through_selective | write_back
    copy_path: str = "sidecar"  # who copies device <-> host: the sidecar, or the engine itself
    cache_id: str = ""  # its host cache: pools of one model and rank slice share one (host_* counted once)
    cache_members: int = 1  # the registered pools sharing that host cache, this one included
    offload_stored: int = 0  # this pool's offloaded keys by answer, ever
    offload_deduplicated: int = 0
    offload_no_space: int = 0
    writes_done: int = 0  # the host cache's storage writes, ever: written, dropped (queue full), failed
    writes_dropped: int = 0
    write_failures: int = 0


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


class EventKind(enum.Enum):
    """What a KV event says; names match hicache.v1.KVEvent.Kind without the KIND_ prefix."""

    STORED = "stored"  # keys are now in `tier`
    REMOVED = "removed"  # keys left `tier` (evicted, deleted, or found corrupt)
    POOL_REGISTERED = "pool_registered"
    POOL_UNREGISTERED = "pool_unregistered"  # and every key it held on host is gone with it


@dataclass(frozen=True)
class EventPool:
    """The pool an event is about: enough for a router to tell engines, groups and ranks apart."""

    pool_id: str
    namespace: str
    model_id: str
    group: str
    tp_rank: int = 0
    tp_size: int = 1


@dataclass(frozen=True)
class KVEvent:
    kind: EventKind
    pool: EventPool
    tier: Tier = Tier.NONE  # HOST or STORAGE for STORED / REMOVED
    keys: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class EventBatch:
    """Events in the order they happened. Each subscription numbers its events from 1, and
    events it lost (a slow subscriber) use up their numbers: `sequence` is the first event's
    number, so a batch that does not start where the last one ended shows a gap, and
    `dropped` says how many were lost just before it (resubscribe with a snapshot to resync)."""

    sequence: int
    events: tuple[KVEvent, ...]
    dropped: int = 0
    timestamp: float = 0.0  # time.time() when the batch was sent
