"""HiCacheClient: what an inference server embeds to drive the sidecar.

    client = HiCacheClient("unix:///run/user/1000/hicache/hicache.sock", token=None)
    pool = client.register(device_pool, namespace="tenant-a", model_id="MiMo-V2-Flash")
    keys = client.page_keys(token_ids)                # chained page hashes, see hicache.keys
    client.offload(keys, device_pages)                # per-key KeyStatus
    handle = client.reload(keys, other_pages, layerwise=True)
    handle.wait_layer(0)                              # layer 0 is on the device
    handle.wait()

One registration covers one KV group (one KVGeometry). A hybrid model registers each
group's pool (group="full", group="swa") and passes pool=... to the other calls; calls
without pool= go to the most recently registered pool. Keys are bytes, namespaces str.
A pool belongs to the client that registered it: every call naming it carries the pool's
secret (from RegisterPool), and other clients get PERMISSION_DENIED. attach(pool_id, secret)
lets another client look up, prefetch, watch, pin and unpin it (a vLLM scheduler reads the
pools its worker processes registered). Every call has a deadline (`timeout` s); mutating calls carry a request id and are retried
on UNAVAILABLE with the same id, which the sidecar answers idempotently. Only register()
waits for a sidecar that is not up yet; any other call to a dead sidecar fails at once with
UNAVAILABLE (after its retries), well within its deadline.
Failed calls raise HiCacheRpcError with the gRPC status code and the sidecar's message.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from hicache.api import (
    ADMIN_TOKEN,
    POOL_SECRET,
    CopyGrant,
    EventBatch,
    EvictResult,
    KeyStatus,
    LookupResult,
    OpEvent,
    PoolStats,
    PrefetchOutcome,
    TransferResult,
)
from hicache.client.connection import Connection
from hicache.client.cuda_events import PoolCudaEvents
from hicache.client.handles import PROBE_S, HiCacheRpcError, ReloadHandle
from hicache.client.progress_blocks import ProgressBlocks
from hicache.client.tls import ClientTls
from hicache.geometry import KVGeometry
from hicache.keys import HashName, page_keys
from hicache.memory import MemoryHandle, SharedBuffer, cuda_available, cuda_index, send_fds
from hicache.rpc import convert
from hicache.rpc.generated import hicache_pb2 as pb

if TYPE_CHECKING:
    from hicache.client.engine_copy import EngineCopy
    from hicache.pools import DeviceKVPool

log = logging.getLogger("hicache.client")

T = TypeVar("T")
CLOSE_S = 2.0  # close() unregisters every pool within this (or the client's timeout, if shorter)


@dataclass(frozen=True)
class RegisteredPool:
    """The sidecar's answer to register(): ids, the host pool, and how keys are hashed."""

    pool_id: str
    group: str
    namespace: str
    page_size: int
    layer_num: int
    key_hash: str
    host_pages: int
    host_shm_name: str
    host_layout: str
    geometry_fingerprint: str
    lease_timeout_s: float
    secret: str = field(default="", repr=False)  # sent with every call naming the pool
    progress_shm_name: str = ""  # the pool's progress block (layer-wise reloads), "" for none


PoolRef = RegisteredPool | str | None  # pool=: what register() returned, its pool_id, or the default


class HiCacheClient:
    """A connection to one sidecar. Thread-safe; close() unregisters this client's pools."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 2,
        tls: ClientTls | None = None,
        admin_token: str | None = None,
    ):
        """`target`: "unix:///path", "/path" or "host:port"; `token`: the sidecar's --token;
        `tls`: CA (and, for mutual TLS, a client certificate) for a sidecar serving TCP over TLS;
        `admin_token`: the sidecar's --admin-token, for stats(all_pools=True)."""
        self._conn = Connection(target, token, timeout=timeout, retries=retries, tls=tls)
        self._stub = self._conn.stub
        self.target = self._conn.target
        self.timeout = timeout
        self.retries = retries
        self._metadata = self._conn.metadata
        self._pools: dict[str, RegisteredPool] = {}
        self._secrets: dict[str, str] = {}  # pool id -> secret, for this client's pools and attached ones
        self._admin = admin_token
        self._default: str | None = None
        self._blocks = ProgressBlocks()  # the progress blocks of this client's pools, mapped
        self._cuda_events: dict[str, PoolCudaEvents] = {}  # CUDA pools: offload and layer events
        self._copiers: dict[str, EngineCopy] = {}  # pools whose copies run here (copy path "engine")

    # ---- plumbing -------------------------------------------------------------------------------
    def _call(
        self,
        method: Callable[..., T],
        request: Any,
        *,
        retry: bool = True,
        wait: bool = False,
        pool: str = "",
        timeout: float | None = None,
    ) -> T:
        """One call; naming `pool`, it carries the pool's secret. `timeout`: the deadline, if
        not the client's."""
        extra = ((POOL_SECRET, self._secrets.get(pool, "")),) if pool else ()
        return self._conn.call(method, request, retry=retry, wait=wait, extra=extra, timeout=timeout)

    def _pool_metadata(self, pool_id: str) -> tuple[tuple[str, str], ...]:
        return (*self._metadata, (POOL_SECRET, self._secrets.get(pool_id, "")))

    def attach(self, pool_id: str, secret: str) -> None:
        """Use a pool another client registered (a vLLM scheduler reads the pools its workers
        registered): lookup, prefetch, watch, pin and unpin then name it with its secret."""
        if not isinstance(pool_id, str) or not pool_id or not isinstance(secret, str) or not secret:
            raise ValueError(f"attach needs a pool id and its secret, got {pool_id!r}")
        self._secrets[pool_id] = secret

    def _pool(self, pool: PoolRef) -> RegisteredPool:
        pool_id = (pool.pool_id if isinstance(pool, RegisteredPool) else pool) or self._default
        if pool_id is None:
            raise ValueError("no pool registered: call register() first")
        if pool_id not in self._pools:
            raise KeyError(f"pool {pool_id!r} was not registered by this client")
        return self._pools[pool_id]

    def _pool_id(self, pool: PoolRef) -> str:
        """The pool a read or pin call names: one of this client's, or one it attached.
        Default: the default pool."""
        if isinstance(pool, RegisteredPool):
            return pool.pool_id
        return pool if pool is not None else self._pool(None).pool_id

    @staticmethod
    def _rid() -> str:
        return uuid.uuid4().hex

    # ---- registration -----------------------------------------------------------------------------
    def register(
        self,
        device_pool: DeviceKVPool,
        *,
        namespace: str = "",
        model_id: str = "",
        group: str = "full",
        key_hash: HashName = "sha256",
        cuda_device: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> RegisteredPool:
        """Register `device_pool` (one KV group) and make it the default pool. The pool must be
        shareable: a CPU pool in shared memory or a CUDA pool exported with CUDA IPC. With
        tensor parallelism each rank registers its own pool with its tp_rank: ranks hold
        different KV heads under the same page keys, so their stored pages are kept apart.
        cuda_device: the pool's CUDA device index, by default the one its memory is on.
        A pool the sidecar cannot map (private memory: memory kind "local") is registered
        with the copy path "engine" (register_engine_copy), and the choice is logged."""
        if device_pool.handle.kind == "local":
            log.info("device pool is in private memory: this process copies it (copy path 'engine')")
            return self.register_engine_copy(
                device_pool.geometry,
                device_pool.num_pages,
                device_pool.memory,
                namespace=namespace,
                model_id=model_id,
                group=group,
                key_hash=key_hash,
                tp_rank=tp_rank,
                tp_size=tp_size,
            )
        if cuda_device is None:
            cuda_device = cuda_index(str(device_pool.flat.device)) if device_pool.flat.is_cuda else 0
        return self.register_memory(
            device_pool.geometry,
            device_pool.num_pages,
            device_pool.handle,
            namespace=namespace,
            model_id=model_id,
            group=group,
            key_hash=key_hash,
            cuda_device=cuda_device,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def register_memory(
        self,
        geometry: KVGeometry,
        num_pages: int,
        memory: MemoryHandle,
        *,
        device_layout: str = "",
        namespace: str = "",
        model_id: str = "",
        group: str = "full",
        key_hash: HashName = "sha256",
        cuda_device: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        wait: bool = True,
    ) -> RegisteredPool:
        """register() for memory the engine lays out itself: num_pages pages of `geometry` in
        `memory` (shm by name, or kind "fd" with the ids send_fds returned), laid out as
        `device_layout` (an EngineLayout name, e.g. "sglang_page_first"; "" is hicache's
        layer_first). The sidecar then copies straight from and to the engine's pages.
        `wait`: wait up to the deadline for a sidecar that is not up yet (False: a sidecar
        that is down fails the call at once with UNAVAILABLE)."""
        if not isinstance(namespace, str):
            raise ValueError(f"namespace must be a str, got {type(namespace).__name__}")
        # a CUDA pool's offloads wait for the caller's stream on the GPU, through these events
        events = PoolCudaEvents.create(cuda_device) if memory.kind == "cuda_ipc" and cuda_available() else None
        request = pb.RegisterPoolRequest(
            request_id=self._rid(),
            group=group,
            geometry=convert.geometry_to_pb(geometry),
            device_pages=num_pages,
            device_memory=convert.memory_to_pb(memory, cuda_device),
            namespace=namespace,
            model_id=model_id,
            key_hash=key_hash,
            tp_rank=tp_rank,
            tp_size=tp_size,
            device_layout=device_layout,
            offload_event_handles=events.offload.handles if events is not None else [],
        )
        try:
            r = self._call(self._stub.RegisterPool, request, wait=wait)
        except BaseException:
            if events is not None:
                events.close()
            raise
        if events is not None:
            events.open_layer_events(r.layer_event_handles, r.layer_event_slots)  # Watch if it cannot
        g = geometry
        info = RegisteredPool(
            r.pool_id,
            group,
            namespace,
            g.page_size,
            g.layer_num,
            r.key_hash,
            r.host_pages,
            r.host_shm_name,
            r.host_layout,
            r.geometry_fingerprint,
            r.lease_timeout.ToNanoseconds() / 1e9,
            r.pool_secret,
            r.progress_shm_name,
        )
        self._pools[info.pool_id] = info
        self._secrets[info.pool_id] = r.pool_secret
        self._blocks.map(info.pool_id, r.progress_shm_name, r.progress_nbytes)
        if events is not None:
            self._cuda_events[info.pool_id] = events
        self._default = info.pool_id
        self._conn.keep_alive(lambda: [(p, i.secret) for p, i in list(self._pools.items())], info.lease_timeout_s)
        return info

    def register_engine_copy(
        self,
        geometry: KVGeometry,
        num_pages: int,
        memory: SharedBuffer,
        *,
        device_layout: str = "",
        namespace: str = "",
        model_id: str = "",
        group: str = "full",
        key_hash: HashName = "sha256",
        tp_rank: int = 0,
        tp_size: int = 1,
        wait: bool = True,
    ) -> RegisteredPool:
        """register_memory() for memory the sidecar cannot map (a private allocation, a CUDA
        pool that cannot be exported): num_pages pages of `geometry` in `memory`, laid out as
        `device_layout` (memory of several allocations, a memory.SpanBuffer, holds one of the
        layout's buffers in each: SGLang's K and V host buffers). This process maps the
        sidecar's host pool and copies itself, and offload() / reload() on the pool run here;
        the sidecar keeps the index, eviction, tiers and pins, and publishes an offloaded page
        only once its copy is done (see hicache.client.engine_copy). Raises ValueError for
        memory too small for the layout, or segments that do not match it, before anything is
        registered."""
        from hicache.client.engine_copy import EngineCopy, local_pool  # torch: loaded with the first pool

        device = local_pool(geometry, num_pages, memory, device_layout)
        info = self.register_memory(
            geometry,
            num_pages,
            MemoryHandle("engine", 0),
            namespace=namespace,
            model_id=model_id,
            group=group,
            key_hash=key_hash,
            tp_rank=tp_rank,
            tp_size=tp_size,
            wait=wait,
        )
        pool_id = info.pool_id
        try:
            copier = EngineCopy.attach(
                device,
                info.host_shm_name,
                info.host_pages,
                info.host_layout,
                lambda keys, offload: self.begin_copy(keys, offload=offload, pool=pool_id),
                lambda grant_id, commit, seconds: self.end_copy(
                    grant_id, commit=commit, copy_seconds=seconds, pool=pool_id
                ),
            )
        except BaseException:
            self.unregister(info, retry=False)
            raise
        self._copiers[pool_id] = copier
        return info

    def begin_copy(self, keys: Sequence[bytes], *, offload: bool, pool: PoolRef = None) -> CopyGrant:
        """BeginCopy: host pages for this process to copy into (offload) or out of (reload)
        itself; end each grant with end_copy. register_engine_copy's pools call it for you."""
        pool_id = self._pool_id(pool)
        req = pb.BeginCopyRequest(request_id=self._rid(), pool_id=pool_id, keys=list(keys), offload=offload)
        r = self._call(self._stub.BeginCopy, req, pool=pool_id)
        statuses = convert.statuses_from_pb(r.statuses)
        return CopyGrant(statuses, tuple(r.host_pages), r.grant_id, r.expires_in.ToNanoseconds() / 1e9)

    def end_copy(self, grant_id: str, *, commit: bool, copy_seconds: float = 0.0, pool: PoolRef = None) -> int:
        """EndCopy: publish an offload grant's pages (commit) or give them back; end a reload
        grant's hold. Returns its pages."""
        pool_id = self._pool_id(pool)
        req = pb.EndCopyRequest(
            request_id=self._rid(), pool_id=pool_id, grant_id=grant_id, commit=commit, copy_seconds=copy_seconds
        )
        return int(self._call(self._stub.EndCopy, req, pool=pool_id).pages)

    def send_fds(self, fds: Sequence[int]) -> list[str]:
        """Hand memfd/shm fds to the sidecar (Unix socket targets only, same uid); returns the
        ids for a MemoryHandle("fd", nbytes, name=",".join(ids)). Raises ValueError or OSError."""
        if not self.target.startswith("unix://"):
            raise ValueError(f"fds can be sent only to a sidecar on a Unix socket, not {self.target!r}")
        return send_fds(self.target.removeprefix("unix://"), fds, timeout=self.timeout)

    def unregister(self, pool: PoolRef = None, *, retry: bool = True, timeout: float | None = None) -> bool:
        """Unregister one of this client's pools (default: the default pool) and drop it here:
        its secret, mapped progress block and CUDA events. True if the sidecar unregistered it;
        False if the sidecar no longer knew it (it restarted, or the lease expired): the pool
        is dropped here all the same, so a re-registration leaves no stale pool behind.
        Raises KeyError for a pool this client did not register, HiCacheRpcError for any
        other failure (the pool is then kept). `timeout`: the deadline, if not the client's."""
        info = self._pool(pool)
        request = pb.UnregisterPoolRequest(request_id=self._rid(), pool_id=info.pool_id)
        try:
            self._call(self._stub.UnregisterPool, request, retry=retry, pool=info.pool_id, timeout=timeout)
            known = True
        except HiCacheRpcError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            known = False  # the sidecar forgot it: nothing there to undo
        self.forget(info)
        return known

    def forget(self, pool: RegisteredPool | str) -> bool:
        """Drop one of this client's pools here only, with no call: its secret, progress block
        and CUDA events; keep-alive stops renewing it. For a pool the sidecar forgot (a call
        naming it got NOT_FOUND) before registering again. False if this client did not hold it."""
        pool_id = pool.pool_id if isinstance(pool, RegisteredPool) else pool
        if pool_id not in self._pools:
            return False
        del self._pools[pool_id]
        self._secrets.pop(pool_id, None)
        copier = self._copiers.pop(pool_id, None)
        if copier is not None:
            copier.close()
        self._blocks.unmap(pool_id)
        events = self._cuda_events.pop(pool_id, None)
        if events is not None:
            events.close()
        if self._default == pool_id:
            self._default = next(iter(self._pools), None)
        return True

    # ---- keys -----------------------------------------------------------------------------------
    def page_keys(
        self, token_ids: Sequence[int] | np.ndarray, parent: bytes | None = None, pool: PoolRef = None
    ) -> list[bytes]:
        """Keys of the full pages of `token_ids` with the pool's page size, namespace and hash."""
        info = self._pool(pool)
        return page_keys(token_ids, info.page_size, info.namespace, parent, info.key_hash)  # type: ignore[arg-type]

    # ---- calls -----------------------------------------------------------------------------------
    def offload(self, keys: Sequence[bytes], device_pages: Sequence[int], *, pool: PoolRef = None) -> TransferResult:
        """Copy device_pages[i] to the host under keys[i]: STORED, DEDUPLICATED or NO_SPACE each.

        A CUDA pool's pages are copied once the work queued on the caller's current stream
        before this call is done (an event the sidecar's copy waits for on the GPU): no
        synchronize is needed first. Record a pool's offloads on one stream (the events are a
        ring of 32; see hicache.client.cuda_events)."""
        pool_id = self._pool(pool).pool_id
        copier = self._copiers.get(pool_id)
        if copier is not None:
            return copier.offload(keys, device_pages)
        events = self._cuda_events.get(pool_id)
        req = pb.OffloadRequest(
            request_id=self._rid(),
            pool_id=pool_id,
            keys=list(keys),
            device_pages=_ints(device_pages),
            ready_event=events.record_ready() if events is not None else 0,
        )
        r = self._call(self._stub.Offload, req, pool=req.pool_id)
        return TransferResult(convert.statuses_from_pb(r.statuses), r.bytes_copied)

    def reload(
        self, keys: Sequence[bytes], device_pages: Sequence[int], *, layerwise: bool = False, pool: PoolRef = None
    ) -> ReloadHandle:
        """Copy keys[i] from the host into device_pages[i]; absent keys are NOT_FOUND and their
        device pages untouched. Not layer-wise, the copy is done when this returns. Layer-wise
        on a CUDA pool, the handle's wait_layer(i) orders the caller's current stream after
        layer i's copy (on the GPU) and returns at once; wait() waits on the host. A copy the
        sidecar starts (CUDA) or makes (CPU, under 4 MB) before answering reports its failure
        as this call's error; later failures come from the handle's waits."""
        info = self._pool(pool)
        copier = self._copiers.get(info.pool_id)
        if copier is not None:  # copied here, before this returns (layer-wise too)
            return ReloadHandle(copier.reload(keys, device_pages), info.layer_num, None)
        req = pb.ReloadRequest(
            request_id=self._rid(),
            pool_id=info.pool_id,
            keys=list(keys),
            device_pages=_ints(device_pages),
            layerwise=layerwise,
        )
        r = self._call(self._stub.Reload, req, pool=req.pool_id)
        result = TransferResult(convert.statuses_from_pb(r.statuses), r.bytes_copied, r.op_id, r.done)
        watch_req = pb.WatchRequest(pool_id=info.pool_id, op_id=r.op_id)

        def watch() -> Any:
            return self._stub.Watch(watch_req, timeout=self.timeout, metadata=self._pool_metadata(info.pool_id))

        def probe() -> None:  # is the sidecar still there, with the pool? (a wait in the slot asks)
            req = pb.KeepAliveRequest(pool_id=info.pool_id)
            self._call(self._stub.KeepAlive, req, retry=False, pool=info.pool_id, timeout=min(self.timeout, PROBE_S))

        slot = stream_wait = None
        if not r.done and r.progress_words:
            slot = self._blocks.slot(info.pool_id, r.progress_slot, r.progress_generation, r.progress_words)
        events = self._cuda_events.get(info.pool_id)
        if not r.done and r.event_layers and events is not None:
            stream_wait = events.layer_waiter(r.event_slot, r.event_layers)
        return ReloadHandle(result, info.layer_num, None if r.done else watch, slot, stream_wait, probe)

    def prefetch(self, keys: Sequence[bytes], *, policy: str = "", pool: PoolRef = None) -> PrefetchOutcome:
        """Bring keys from the storage tier into host memory: each key is RESIDENT, FETCHING
        (best_effort: still going; watch(op_id) streams progress), FETCHED, NO_SPACE (pinned
        or referenced pages fill the host pool), NOT_FOUND (in storage but not brought in:
        after a gap in the chain, or the fetch failed or was cancelled) or MISSING (no tier).
        policy: best_effort | wait_complete | timeout; "" uses the sidecar's default."""
        req = pb.PrefetchRequest(request_id=self._rid(), pool_id=self._pool_id(pool), keys=list(keys), policy=policy)
        r = self._call(self._stub.Prefetch, req, pool=req.pool_id)
        return PrefetchOutcome(convert.statuses_from_pb(r.statuses), r.op_id, r.done, r.timed_out)

    def watch(self, op_id: str, *, pool: PoolRef = None, no_deadline: bool = False) -> Iterator[OpEvent]:
        """The progress events of an operation (a layer-wise reload or a prefetch) until it ends.

        The whole stream has the client's timeout as its deadline; no_deadline=True follows
        the operation however long it runs (a large best_effort prefetch)."""
        req = pb.WatchRequest(pool_id=self._pool_id(pool), op_id=op_id)
        deadline = None if no_deadline else self.timeout
        try:
            for msg in self._stub.Watch(req, timeout=deadline, metadata=self._pool_metadata(req.pool_id)):
                yield convert.event_from_pb(msg)
        except grpc.RpcError as exc:
            raise HiCacheRpcError(exc.code(), exc.details() or "") from None

    def events(
        self, namespace: str | None = None, *, snapshot: bool = True, duration: float | None = None
    ) -> Iterator[EventBatch]:
        """The sidecar's KV events (needs the client's admin_token): of the pools in `namespace`,
        or of every namespace for None. With snapshot, it opens with each pool's
        POOL_REGISTERED and STORED(host, its resident keys). Runs until the caller stops
        iterating, the sidecar stops, or `duration` s have passed (then it ends quietly).
        EventBatch.dropped > 0: events were lost (the subscriber fell behind); subscribe
        again for a fresh snapshot. Raises HiCacheRpcError (PERMISSION_DENIED without the token)."""
        req = pb.SubscribeEventsRequest(
            all_namespaces=namespace is None, namespace=namespace or "", skip_snapshot=not snapshot
        )
        metadata = (*self._metadata, *(((ADMIN_TOKEN, self._admin),) if self._admin else ()))
        stream = self._stub.SubscribeEvents(req, timeout=duration, metadata=metadata)
        try:
            for msg in stream:
                yield convert.event_batch_from_pb(msg)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                return
            raise HiCacheRpcError(exc.code(), exc.details() or "") from None
        finally:
            stream.cancel()

    def evict(self, keys: Sequence[bytes] = (), num_pages: int = 0, *, pool: PoolRef = None) -> EvictResult:
        """Drop `keys`, or free num_pages host pages, least recently used first."""
        req = pb.EvictRequest(
            request_id=self._rid(), pool_id=self._pool(pool).pool_id, keys=list(keys), num_pages=num_pages
        )
        r = self._call(self._stub.Evict, req, pool=req.pool_id)
        return EvictResult(convert.statuses_from_pb(r.statuses), r.pages_freed)

    def lookup(self, keys: Sequence[bytes], *, pool: PoolRef = None) -> LookupResult:
        req = pb.LookupRequest(pool_id=self._pool_id(pool), keys=list(keys))
        return convert.lookup_from_pb(self._call(self._stub.Lookup, req, pool=req.pool_id))

    def pin(self, keys: Sequence[bytes], *, pool: PoolRef = None) -> tuple[KeyStatus, ...]:
        req = pb.PinRequest(request_id=self._rid(), pool_id=self._pool_id(pool), keys=list(keys))
        return convert.statuses_from_pb(self._call(self._stub.Pin, req, pool=req.pool_id).statuses)

    def unpin(self, keys: Sequence[bytes], *, pool: PoolRef = None) -> tuple[KeyStatus, ...]:
        req = pb.UnpinRequest(request_id=self._rid(), pool_id=self._pool_id(pool), keys=list(keys))
        return convert.statuses_from_pb(self._call(self._stub.Unpin, req, pool=req.pool_id).statuses)

    def keep_alive(self, pool: PoolRef = None) -> None:
        """Renew one of this client's pools' lease now (the keep-alive thread does it every
        lease/3). Raises HiCacheRpcError: NOT_FOUND once the sidecar forgot the pool (it
        restarted, or the lease ran out), UNAVAILABLE at once while it is down."""
        pool_id = self._pool(pool).pool_id
        self._call(self._stub.KeepAlive, pb.KeepAliveRequest(pool_id=pool_id), retry=False, pool=pool_id)

    def stats(self, pool: PoolRef = None, *, all_pools: bool = False) -> list[PoolStats]:
        """Stats of one of this client's pools (default: the default pool), or of every pool on
        the sidecar (all_pools=True: needs the client's admin_token)."""
        if all_pools:  # every pool's id and namespace: the sidecar's admin token only
            extra = ((ADMIN_TOKEN, self._admin),) if self._admin else ()
            request = pb.GetStatsRequest()
            r = self._conn.call(self._stub.GetStats, request, extra=extra)
        else:
            pool_id = self._pool(pool).pool_id
            r = self._call(self._stub.GetStats, pb.GetStatsRequest(pool_id=pool_id), pool=pool_id)
        return [convert.stats_from_pb(s) for s in r.pools]

    def close(self) -> None:
        """Unregister this client's pools (best effort, all within CLOSE_S, so a wedged
        sidecar holds it that long at most: a pool it does not release in time goes with its
        lease) and close the channel. Idempotent."""
        self._conn.stop_keep_alive()
        end = time.monotonic() + min(self.timeout, CLOSE_S)
        for pool_id in list(self._pools):
            left = end - time.monotonic()
            try:
                if left <= 0:
                    raise HiCacheRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "close() ran out of time")
                self.unregister(pool_id, retry=False, timeout=left)  # a dead sidecar fails fast
            except HiCacheRpcError:
                self.forget(pool_id)
        self._blocks.close()
        for events in self._cuda_events.values():
            events.close()
        self._cuda_events.clear()
        self._conn.close()

    def __enter__(self) -> HiCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ints(pages: Sequence[int] | np.ndarray) -> list[int]:
    return [int(p) for p in (pages.tolist() if isinstance(pages, np.ndarray) else pages)]
