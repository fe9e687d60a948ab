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

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from hicache.api import (
    ADMIN_TOKEN,
    EventBatch,
    EvictResult,
    KeyStatus,
    LookupResult,
    OpEvent,
    PoolStats,
    PrefetchOutcome,
    TransferResult,
)
from hicache.client.client_pools import PoolRef, RegisteredPool
from hicache.client.connection import Connection
from hicache.client.cuda_events import PoolCudaEvents
from hicache.client.handles import PROBE_S, HiCacheRpcError, ReloadHandle
from hicache.client.progress_blocks import ProgressBlocks
from hicache.client.registration import PoolRegistration
from hicache.client.tls import ClientTls
from hicache.keys import page_keys
from hicache.rpc import convert
from hicache.rpc.generated import hicache_pb2 as pb

if TYPE_CHECKING:
    from hicache.client.engine_copy import EngineCopy

CLOSE_S = 2.0  # close() unregisters every pool within this (or the client's timeout, if shorter)


class HiCacheClient(PoolRegistration):
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
