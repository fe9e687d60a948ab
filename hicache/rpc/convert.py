"""Conversions between hicache.v1 protobuf messages and the library's types.

Shared by the servicer and the client so that both sides read and write one format.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hicache.api import (
    EventBatch,
    EventKind,
    EventPool,
    KeyStatus,
    KVEvent,
    LookupResult,
    OpEvent,
    PoolStats,
    Tier,
    TierStats,
)
from hicache.geometry import KVGeometry
from hicache.memory import MemoryHandle
from hicache.rpc.generated import hicache_pb2 as pb

_EVENT_KINDS = {
    "layer_done": pb.WatchEvent.KIND_LAYER_DONE,
    "done": pb.WatchEvent.KIND_DONE,
    "failed": pb.WatchEvent.KIND_FAILED,
    "progress": pb.WatchEvent.KIND_PROGRESS,
}
_EVENT_NAMES = {v: k for k, v in _EVENT_KINDS.items()}
UNKNOWN_STATUS = KeyStatus.NOT_FOUND  # what an unknown KeyStatus value reads as
_STATUSES = {pb.KeyStatus.Value("KEY_STATUS_" + s.name): s for s in KeyStatus}
_TIERS = {pb.Tier.Value("TIER_" + t.name): t for t in Tier}


def geometry_to_pb(g: KVGeometry) -> pb.Geometry:
    d = g.to_dict()
    return pb.Geometry(**d)


def geometry_from_pb(msg: pb.Geometry) -> KVGeometry:
    """Raises ValueError (from KVGeometry) for an invalid geometry."""
    mla = msg.attention == "mla"
    return KVGeometry(
        attention=msg.attention,  # type: ignore[arg-type]  # KVGeometry validates it
        layer_num=msg.layer_num,
        head_num=msg.head_num,
        head_dim=None if mla and not msg.head_dim else msg.head_dim,
        v_head_dim=None if mla and not msg.v_head_dim else msg.v_head_dim,
        kv_lora_rank=msg.kv_lora_rank,
        qk_rope_head_dim=msg.qk_rope_head_dim,
        page_size=msg.page_size,
        dtype=msg.dtype,
        layer_ids=tuple(msg.layer_ids) if msg.layer_ids else None,
    )


def memory_to_pb(h: MemoryHandle, cuda_device: int = 0) -> pb.MemoryHandle:
    return pb.MemoryHandle(
        kind=h.kind,
        nbytes=h.nbytes,
        shm_name=h.name,
        cuda_ipc_handle=h.ipc_handle,
        offset=h.offset,
        cuda_device=cuda_device,
        proof=h.proof,
    )


def memory_from_pb(msg: pb.MemoryHandle) -> MemoryHandle:
    if msg.kind not in ("shm", "cuda_ipc", "fd", "engine"):
        raise ValueError(f"device memory kind must be 'shm', 'cuda_ipc', 'fd' or 'engine', got {msg.kind!r}")
    return MemoryHandle(
        msg.kind,  # type: ignore[arg-type]
        msg.nbytes,
        name=msg.shm_name,
        ipc_handle=msg.cuda_ipc_handle,
        offset=msg.offset,
        proof=msg.proof,
    )


def statuses_to_pb(statuses: Iterable[KeyStatus]) -> list[Any]:
    return [pb.KeyStatus.Value("KEY_STATUS_" + s.name) for s in statuses]


def statuses_from_pb(values: Iterable[int]) -> tuple[KeyStatus, ...]:
    """A value this side does not know (a newer sidecar's, or UNSPECIFIED) reads as
    UNKNOWN_STATUS, which every caller takes for a miss: not stored, not loaded, not pinned."""
    return tuple(_STATUSES.get(v, UNKNOWN_STATUS) for v in values)


def tier_to_pb(t: Tier) -> Any:
    return pb.Tier.Value("TIER_" + t.name)


def tier_from_pb(v: int) -> Tier:
    """A tier this side does not know (a newer sidecar's, or UNSPECIFIED) reads as Tier.NONE:
    the key counts as in no tier, a miss."""
    return _TIERS.get(v, Tier.NONE)


def lookup_to_pb(r: LookupResult) -> pb.LookupResponse:
    return pb.LookupResponse(prefix_length=r.prefix_length, tiers=[tier_to_pb(t) for t in r.tiers])


def lookup_from_pb(msg: pb.LookupResponse) -> LookupResult:
    return LookupResult(msg.prefix_length, tuple(tier_from_pb(t) for t in msg.tiers))


def event_to_pb(op_id: str, e: OpEvent) -> pb.WatchEvent:
    return pb.WatchEvent(
        op_id=op_id,
        kind=_EVENT_KINDS[e.kind],
        layer=e.layer,
        layers_done=e.layers_done,
        layer_num=e.layer_num,
        error=e.error,
    )


def event_from_pb(msg: pb.WatchEvent) -> OpEvent:
    return OpEvent(_EVENT_NAMES.get(msg.kind, "failed"), msg.layer, msg.layers_done, msg.layer_num, msg.error)


def stats_to_pb(s: PoolStats) -> pb.PoolStats:
    tiers = [
        pb.TierStats(
            tier=tier_to_pb(t.tier),
            pages=t.pages,
            bytes=t.bytes,
            hits=t.hits,
            misses=t.misses,
            capacity_bytes=t.capacity_bytes,
        )
        for t in s.tiers
    ]
    return pb.PoolStats(
        pool_id=s.pool_id,
        group=s.group,
        namespace=s.namespace,
        model_id=s.model_id,
        device_pages=s.device_pages,
        host_pages=s.host_pages,
        used_pages=s.used_pages,
        pinned_pages=s.pinned_pages,
        page_bytes=s.page_bytes,
        tiers=tiers,
        offload_bytes=s.offload_bytes,
        offload_gbps=s.offload_gbps,
        reload_bytes=s.reload_bytes,
        reload_gbps=s.reload_gbps,
        ops_in_flight=s.ops_in_flight,
        storage_backend=s.storage_backend,
        storage_healthy=s.storage_healthy,
        storage_write_queue=s.storage_write_queue,
        copy_backend=s.copy_backend,
        storage_nodes_down=list(s.storage_nodes_down),
        write_policy=s.write_policy,
        copy_path=s.copy_path,
        cache_id=s.cache_id,
        cache_members=s.cache_members,
        offload_stored=s.offload_stored,
        offload_deduplicated=s.offload_deduplicated,
        offload_no_space=s.offload_no_space,
        writes_done=s.writes_done,
        writes_dropped=s.writes_dropped,
        write_failures=s.write_failures,
    )


def stats_from_pb(m: pb.PoolStats) -> PoolStats:
    tiers = tuple(
        TierStats(tier_from_pb(t.tier), t.pages, t.bytes, t.hits, t.misses, t.capacity_bytes) for t in m.tiers
    )
    return PoolStats(
        m.pool_id,
        m.group,
        m.namespace,
        m.model_id,
        m.device_pages,
        m.host_pages,
        m.used_pages,
        m.pinned_pages,
        m.page_bytes,
        tiers,
        m.offload_bytes,
        m.offload_gbps,
        m.reload_bytes,
        m.reload_gbps,
        m.ops_in_flight,
        m.storage_backend,
        m.storage_healthy,
        m.storage_write_queue,
        m.copy_backend,
        tuple(m.storage_nodes_down),
        m.write_policy,
        m.copy_path or "sidecar",
        m.cache_id,
        m.cache_members or 1,
        m.offload_stored,
        m.offload_deduplicated,
        m.offload_no_space,
        m.writes_done,
        m.writes_dropped,
        m.write_failures,
    )


def event_batch_to_pb(batch: EventBatch) -> pb.EventBatch:
    events = []
    for e in batch.events:
        p = e.pool
        changed = e.kind in (EventKind.STORED, EventKind.REMOVED)
        events.append(
            pb.KVEvent(
                kind=pb.KVEvent.Kind.Value("KIND_" + e.kind.name),
                tier=tier_to_pb(e.tier) if changed else pb.TIER_UNSPECIFIED,
                keys=list(e.keys),
                pool_id=p.pool_id,
                namespace=p.namespace,
                model_id=p.model_id,
                group=p.group,
                tp_rank=p.tp_rank,
                tp_size=p.tp_size,
            )
        )
    return pb.EventBatch(sequence=batch.sequence, events=events, dropped=batch.dropped, timestamp=batch.timestamp)


def event_batch_from_pb(msg: pb.EventBatch) -> EventBatch:
    events = []
    for e in msg.events:
        kind = _event_kind(e.kind)
        if kind is None:  # a kind of a newer sidecar: skipped, not guessed
            continue
        pool = EventPool(e.pool_id, e.namespace, e.model_id, e.group, e.tp_rank, e.tp_size)
        events.append(KVEvent(kind, pool, tier_from_pb(e.tier) if e.tier else Tier.NONE, tuple(e.keys)))
    return EventBatch(msg.sequence, tuple(events), msg.dropped, msg.timestamp)


def _event_kind(value: int) -> EventKind | None:
    name = {v: k for k, v in pb.KVEvent.Kind.items()}.get(value, "KIND_UNSPECIFIED").removeprefix("KIND_")
    return EventKind.__members__.get(name)
