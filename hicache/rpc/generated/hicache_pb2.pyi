import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KeyStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_STATUS_UNSPECIFIED: _ClassVar[KeyStatus]
    KEY_STATUS_STORED: _ClassVar[KeyStatus]
    KEY_STATUS_DEDUPLICATED: _ClassVar[KeyStatus]
    KEY_STATUS_NO_SPACE: _ClassVar[KeyStatus]
    KEY_STATUS_LOADED: _ClassVar[KeyStatus]
    KEY_STATUS_NOT_FOUND: _ClassVar[KeyStatus]
    KEY_STATUS_RESIDENT: _ClassVar[KeyStatus]
    KEY_STATUS_MISSING: _ClassVar[KeyStatus]
    KEY_STATUS_EVICTED: _ClassVar[KeyStatus]
    KEY_STATUS_BUSY: _ClassVar[KeyStatus]
    KEY_STATUS_PINNED: _ClassVar[KeyStatus]
    KEY_STATUS_UNPINNED: _ClassVar[KeyStatus]
    KEY_STATUS_NOT_PINNED: _ClassVar[KeyStatus]
    KEY_STATUS_LOADED_FROM_STORAGE: _ClassVar[KeyStatus]
    KEY_STATUS_FETCHING: _ClassVar[KeyStatus]
    KEY_STATUS_FETCHED: _ClassVar[KeyStatus]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_NONE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_STORAGE: _ClassVar[Tier]
KEY_STATUS_UNSPECIFIED: KeyStatus
KEY_STATUS_STORED: KeyStatus
KEY_STATUS_DEDUPLICATED: KeyStatus
KEY_STATUS_NO_SPACE: KeyStatus
KEY_STATUS_LOADED: KeyStatus
KEY_STATUS_NOT_FOUND: KeyStatus
KEY_STATUS_RESIDENT: KeyStatus
KEY_STATUS_MISSING: KeyStatus
KEY_STATUS_EVICTED: KeyStatus
KEY_STATUS_BUSY: KeyStatus
KEY_STATUS_PINNED: KeyStatus
KEY_STATUS_UNPINNED: KeyStatus
KEY_STATUS_NOT_PINNED: KeyStatus
KEY_STATUS_LOADED_FROM_STORAGE: KeyStatus
KEY_STATUS_FETCHING: KeyStatus
KEY_STATUS_FETCHED: KeyStatus
TIER_UNSPECIFIED: Tier
TIER_NONE: Tier
TIER_HOST: Tier
TIER_STORAGE: Tier

class Geometry(_message.Message):
    __slots__ = ("attention", "layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "page_size", "dtype", "layer_ids")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    LAYER_NUM_FIELD_NUMBER: _ClassVar[int]
    HEAD_NUM_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    V_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    attention: str
    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    page_size: int
    dtype: str
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, attention: _Optional[str] = ..., layer_num: _Optional[int] = ..., head_num: _Optional[int] = ..., head_dim: _Optional[int] = ..., v_head_dim: _Optional[int] = ..., kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., layer_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MemoryHandle(_message.Message):
    __slots__ = ("kind", "nbytes", "shm_name", "cuda_ipc_handle", "offset", "cuda_device", "proof")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    kind: str
    nbytes: int
    shm_name: str
    cuda_ipc_handle: bytes
    offset: int
    cuda_device: int
    proof: str
    def __init__(self, kind: _Optional[str] = ..., nbytes: _Optional[int] = ..., shm_name: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., cuda_device: _Optional[int] = ..., proof: _Optional[str] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("request_id", "group", "geometry", "device_pages", "device_memory", "namespace", "model_id", "key_hash", "tp_rank", "tp_size", "device_layout", "offload_event_handles")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_HASH_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    group: str
    geometry: Geometry
    device_pages: int
    device_memory: MemoryHandle
    namespace: str
    model_id: str
    key_hash: str
    tp_rank: int
    tp_size: int
    device_layout: str
    offload_event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., group: _Optional[str] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ..., device_pages: _Optional[int] = ..., device_memory: _Optional[_Union[MemoryHandle, _Mapping]] = ..., namespace: _Optional[str] = ..., model_id: _Optional[str] = ..., key_hash: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., device_layout: _Optional[str] = ..., offload_event_handles: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "host_pages", "host_shm_name", "host_layout", "host_nbytes", "geometry_fingerprint", "key_hash", "key_bytes", "lease_timeout", "pool_secret", "progress_shm_name", "progress_nbytes", "layer_event_handles", "layer_event_slots", "window_shm_name", "window_pages")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HOST_NBYTES_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEY_HASH_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    POOL_SECRET_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_NBYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    LAYER_EVENT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    host_pages: int
    host_shm_name: str
    host_layout: str
    host_nbytes: int
    geometry_fingerprint: str
    key_hash: str
    key_bytes: int
    lease_timeout: _duration_pb2.Duration
    pool_secret: str
    progress_shm_name: str
    progress_nbytes: int
    layer_event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    layer_event_slots: int
    window_shm_name: str
    window_pages: int
    def __init__(self, pool_id: _Optional[str] = ..., host_pages: _Optional[int] = ..., host_shm_name: _Optional[str] = ..., host_layout: _Optional[str] = ..., host_nbytes: _Optional[int] = ..., geometry_fingerprint: _Optional[str] = ..., key_hash: _Optional[str] = ..., key_bytes: _Optional[int] = ..., lease_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., pool_secret: _Optional[str] = ..., progress_shm_name: _Optional[str] = ..., progress_nbytes: _Optional[int] = ..., layer_event_handles: _Optional[_Iterable[bytes]] = ..., layer_event_slots: _Optional[int] = ..., window_shm_name: _Optional[str] = ..., window_pages: _Optional[int] = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("request_id", "pool_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ...) -> None: ...

class UnregisterPoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_timeout",)
    LEASE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    lease_timeout: _duration_pb2.Duration
    def __init__(self, lease_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ("request_id", "pool_id", "keys", "device_pages", "ready_event")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    ready_event: int
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., device_pages: _Optional[_Iterable[int]] = ..., ready_event: _Optional[int] = ...) -> None: ...

class OffloadResponse(_message.Message):
    __slots__ = ("statuses", "bytes_copied")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    bytes_copied: int
    def __init__(self, statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ..., bytes_copied: _Optional[int] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ("request_id", "pool_id", "keys", "device_pages", "layerwise")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    layerwise: bool
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., device_pages: _Optional[_Iterable[int]] = ..., layerwise: _Optional[bool] = ...) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("statuses", "op_id", "done", "bytes_copied", "progress_slot", "progress_generation", "progress_words", "event_slot", "event_layers")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_SLOT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_WORDS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SLOT_FIELD_NUMBER: _ClassVar[int]
    EVENT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    op_id: str
    done: bool
    bytes_copied: int
    progress_slot: int
    progress_generation: int
    progress_words: int
    event_slot: int
    event_layers: int
    def __init__(self, statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ..., op_id: _Optional[str] = ..., done: _Optional[bool] = ..., bytes_copied: _Optional[int] = ..., progress_slot: _Optional[int] = ..., progress_generation: _Optional[int] = ..., progress_words: _Optional[int] = ..., event_slot: _Optional[int] = ..., event_layers: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("request_id", "pool_id", "keys", "policy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    policy: str
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., policy: _Optional[str] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("statuses", "op_id", "done", "timed_out")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    op_id: str
    done: bool
    timed_out: bool
    def __init__(self, statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ..., op_id: _Optional[str] = ..., done: _Optional[bool] = ..., timed_out: _Optional[bool] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("request_id", "pool_id", "keys", "num_pages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    num_pages: int
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., num_pages: _Optional[int] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("statuses", "pages_freed")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    pages_freed: int
    def __init__(self, statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ..., pages_freed: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("pool_id", "keys")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length", "tiers")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, prefix_length: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("request_id", "pool_id", "keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("request_id", "pool_id", "keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "pages", "bytes", "hits", "misses", "capacity_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    pages: int
    bytes: int
    hits: int
    misses: int
    capacity_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool_id", "group", "namespace", "model_id", "device_pages", "host_pages", "used_pages", "pinned_pages", "page_bytes", "tiers", "offload_bytes", "offload_gbps", "reload_bytes", "reload_gbps", "ops_in_flight", "storage_backend", "storage_healthy", "storage_write_queue", "copy_backend", "storage_nodes_down", "write_policy", "copy_path", "cache_id", "cache_members", "offload_stored", "offload_deduplicated", "offload_no_space", "writes_done", "writes_dropped", "write_failures")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_GBPS_FIELD_NUMBER: _ClassVar[int]
    RELOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELOAD_GBPS_FIELD_NUMBER: _ClassVar[int]
    OPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    STORAGE_WRITE_QUEUE_FIELD_NUMBER: _ClassVar[int]
    COPY_BACKEND_FIELD_NUMBER: _ClassVar[int]
    STORAGE_NODES_DOWN_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    COPY_PATH_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_STORED_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_NO_SPACE_FIELD_NUMBER: _ClassVar[int]
    WRITES_DONE_FIELD_NUMBER: _ClassVar[int]
    WRITES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    group: str
    namespace: str
    model_id: str
    device_pages: int
    host_pages: int
    used_pages: int
    pinned_pages: int
    page_bytes: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    offload_bytes: int
    offload_gbps: float
    reload_bytes: int
    reload_gbps: float
    ops_in_flight: int
    storage_backend: str
    storage_healthy: bool
    storage_write_queue: int
    copy_backend: str
    storage_nodes_down: _containers.RepeatedScalarFieldContainer[str]
    write_policy: str
    copy_path: str
    cache_id: str
    cache_members: int
    offload_stored: int
    offload_deduplicated: int
    offload_no_space: int
    writes_done: int
    writes_dropped: int
    write_failures: int
    def __init__(self, pool_id: _Optional[str] = ..., group: _Optional[str] = ..., namespace: _Optional[str] = ..., model_id: _Optional[str] = ..., device_pages: _Optional[int] = ..., host_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., offload_bytes: _Optional[int] = ..., offload_gbps: _Optional[float] = ..., reload_bytes: _Optional[int] = ..., reload_gbps: _Optional[float] = ..., ops_in_flight: _Optional[int] = ..., storage_backend: _Optional[str] = ..., storage_healthy: _Optional[bool] = ..., storage_write_queue: _Optional[int] = ..., copy_backend: _Optional[str] = ..., storage_nodes_down: _Optional[_Iterable[str]] = ..., write_policy: _Optional[str] = ..., copy_path: _Optional[str] = ..., cache_id: _Optional[str] = ..., cache_members: _Optional[int] = ..., offload_stored: _Optional[int] = ..., offload_deduplicated: _Optional[int] = ..., offload_no_space: _Optional[int] = ..., writes_done: _Optional[int] = ..., writes_dropped: _Optional[int] = ..., write_failures: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("pools", "ops_in_flight")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    OPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    ops_in_flight: int
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., ops_in_flight: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("pool_id", "op_id")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    op_id: str
    def __init__(self, pool_id: _Optional[str] = ..., op_id: _Optional[str] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("op_id", "kind", "layer", "layers_done", "layer_num", "error")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WatchEvent.Kind]
        KIND_LAYER_DONE: _ClassVar[WatchEvent.Kind]
        KIND_DONE: _ClassVar[WatchEvent.Kind]
        KIND_FAILED: _ClassVar[WatchEvent.Kind]
        KIND_PROGRESS: _ClassVar[WatchEvent.Kind]
    KIND_UNSPECIFIED: WatchEvent.Kind
    KIND_LAYER_DONE: WatchEvent.Kind
    KIND_DONE: WatchEvent.Kind
    KIND_FAILED: WatchEvent.Kind
    KIND_PROGRESS: WatchEvent.Kind
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    LAYER_NUM_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    kind: WatchEvent.Kind
    layer: int
    layers_done: int
    layer_num: int
    error: str
    def __init__(self, op_id: _Optional[str] = ..., kind: _Optional[_Union[WatchEvent.Kind, str]] = ..., layer: _Optional[int] = ..., layers_done: _Optional[int] = ..., layer_num: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class SubscribeEventsRequest(_message.Message):
    __slots__ = ("all_namespaces", "namespace", "skip_snapshot")
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SKIP_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    all_namespaces: bool
    namespace: str
    skip_snapshot: bool
    def __init__(self, all_namespaces: _Optional[bool] = ..., namespace: _Optional[str] = ..., skip_snapshot: _Optional[bool] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "tier", "keys", "pool_id", "namespace", "model_id", "group", "tp_rank", "tp_size")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        KIND_STORED: _ClassVar[KVEvent.Kind]
        KIND_REMOVED: _ClassVar[KVEvent.Kind]
        KIND_POOL_REGISTERED: _ClassVar[KVEvent.Kind]
        KIND_POOL_UNREGISTERED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    KIND_STORED: KVEvent.Kind
    KIND_REMOVED: KVEvent.Kind
    KIND_POOL_REGISTERED: KVEvent.Kind
    KIND_POOL_UNREGISTERED: KVEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    kind: KVEvent.Kind
    tier: Tier
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pool_id: str
    namespace: str
    model_id: str
    group: str
    tp_rank: int
    tp_size: int
    def __init__(self, kind: _Optional[_Union[KVEvent.Kind, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., keys: _Optional[_Iterable[bytes]] = ..., pool_id: _Optional[str] = ..., namespace: _Optional[str] = ..., model_id: _Optional[str] = ..., group: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("sequence", "events", "dropped", "timestamp")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    dropped: int
    timestamp: float
    def __init__(self, sequence: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., dropped: _Optional[int] = ..., timestamp: _Optional[float] = ...) -> None: ...

class BeginCopyRequest(_message.Message):
    __slots__ = ("request_id", "pool_id", "offload", "keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    offload: bool
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., offload: _Optional[bool] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BeginCopyResponse(_message.Message):
    __slots__ = ("statuses", "host_pages", "grant_id", "expires_in")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KeyStatus]
    host_pages: _containers.RepeatedScalarFieldContainer[int]
    grant_id: str
    expires_in: _duration_pb2.Duration
    def __init__(self, statuses: _Optional[_Iterable[_Union[KeyStatus, str]]] = ..., host_pages: _Optional[_Iterable[int]] = ..., grant_id: _Optional[str] = ..., expires_in: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class EndCopyRequest(_message.Message):
    __slots__ = ("request_id", "pool_id", "grant_id", "commit", "copy_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    COPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    grant_id: str
    commit: bool
    copy_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., grant_id: _Optional[str] = ..., commit: _Optional[bool] = ..., copy_seconds: _Optional[float] = ...) -> None: ...

class EndCopyResponse(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    def __init__(self, pages: _Optional[int] = ...) -> None: ...
