"""The HiCache gRPC servicer: converts messages and maps the service's errors to status codes.

It holds no logic of its own. ValueError -> INVALID_ARGUMENT, UnknownId -> NOT_FOUND,
StateError -> FAILED_PRECONDITION, a NoSpace return (or a stream beyond the server's
StreamSlots) -> RESOURCE_EXHAUSTED, anything else -> INTERNAL. Authentication is the interceptor's job (server/auth.py).
The mapping itself is in server/error_mapping.py.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterator

import grpc
from google.protobuf import duration_pb2

from hicache.api import ADMIN_TOKEN, POOL_SECRET
from hicache.rpc import convert
from hicache.rpc.generated import hicache_pb2 as pb
from hicache.rpc.generated import hicache_pb2_grpc as pb_grpc
from hicache.sidecar.errors import NoSpace, UnknownId
from hicache.sidecar.events import Subscription
from hicache.sidecar.service import HiCacheService

from .drain import Drain
from .error_mapping import Exhausted, Forbidden, abort_for, mapped_errors
from .streams import StreamSlots


class HiCacheServicer(pb_grpc.HiCacheServicer):
    """Pools belong to whoever registered them: every call naming a pool must carry the pool's
    secret (RegisterPool's pool_secret) as metadata, or gets PERMISSION_DENIED; stats of all
    pools need the admin token (--admin-token)."""

    def __init__(self, service: HiCacheService, admin_token: str | None, streams: StreamSlots):
        self.service = service
        self.admin_token = admin_token
        self._ending = threading.Event()
        self.streams = streams  # the server's, sized from --workers (ServerConfig.max_streams)
        self.drain = Drain()  # the unary calls in flight, finished before gRPC stops (server.app)

    def end_streams(self) -> None:
        """End every SubscribeEvents stream, each after what it has queued (shutdown: the
        server takes no new calls, and an open stream would hold it for the whole grace)."""
        self._ending.set()
        self.service.events.close()

    def _own(self, pool_id: str, context: grpc.ServicerContext, *, gone_ok: bool = False) -> None:
        """Raises Forbidden unless the call carries pool_id's secret (UnknownId for no such pool,
        unless gone_ok: the service then answers, e.g. a retried UnregisterPool from its cache)."""
        given = _metadata(context, POOL_SECRET)
        try:
            mine = self.service.owns(pool_id, given)
        except UnknownId:
            if gone_ok:
                return
            raise
        if not mine:
            raise Forbidden(f"pool {pool_id!r}: {'wrong' if given else 'missing'} pool secret ({POOL_SECRET})")

    def _admin(self, context: grpc.ServicerContext, what: str = "stats of all pools") -> None:
        if self.admin_token is None:
            raise Forbidden(f"{what} need the sidecar's --admin-token")
        given = _metadata(context, ADMIN_TOKEN)
        if not hmac.compare_digest(given.encode(), self.admin_token.encode()):
            raise Forbidden(f"{what}: {'wrong' if given else 'missing'} admin token ({ADMIN_TOKEN})")

    @mapped_errors
    def RegisterPool(self, request: pb.RegisterPoolRequest, context: grpc.ServicerContext) -> pb.RegisterPoolResponse:
        if not request.HasField("geometry") or not request.HasField("device_memory"):
            raise ValueError("RegisterPool needs geometry and device_memory")
        info = self.service.register(
            request.request_id,
            geometry=convert.geometry_from_pb(request.geometry),
            device_pages=request.device_pages,
            device_memory=convert.memory_from_pb(request.device_memory),
            group=request.group or "full",
            namespace=request.namespace,
            model_id=request.model_id,
            key_hash=request.key_hash or "sha256",
            cuda_device=request.device_memory.cuda_device,
            tp_rank=request.tp_rank,
            tp_size=request.tp_size or 1,
            device_layout=request.device_layout,
            offload_events=list(request.offload_event_handles),
        )
        if isinstance(info, NoSpace):
            raise Exhausted(info.reason)
        if not context.is_active():  # its caller gave up (deadline, cancel): keep nothing for it
            self.service.abandon(info.pool_id)
        return pb.RegisterPoolResponse(
            pool_id=info.pool_id,
            host_pages=info.host_pages,
            host_shm_name=info.host_shm_name,
            host_layout=info.host_layout,
            host_nbytes=info.host_nbytes,
            geometry_fingerprint=info.geometry_fingerprint,
            key_hash=info.key_hash,
            key_bytes=info.key_bytes,
            lease_timeout=_duration(info.lease_timeout_s),
            pool_secret=info.pool_secret,
            progress_shm_name=info.progress_shm_name,
            progress_nbytes=info.progress_nbytes,
            layer_event_handles=list(info.layer_event_handles),
            layer_event_slots=info.layer_event_slots,
            window_shm_name=info.window_shm_name,
            window_pages=info.window_pages,
        )

    @mapped_errors
    def UnregisterPool(
        self, request: pb.UnregisterPoolRequest, context: grpc.ServicerContext
    ) -> pb.UnregisterPoolResponse:
        self._own(request.pool_id, context, gone_ok=True)
        self.service.unregister(request.request_id, request.pool_id)
        return pb.UnregisterPoolResponse()

    @mapped_errors
    def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.ServicerContext) -> pb.KeepAliveResponse:
        self._own(request.pool_id, context)
        return pb.KeepAliveResponse(lease_timeout=_duration(self.service.keep_alive(request.pool_id)))

    @mapped_errors
    def Offload(self, request: pb.OffloadRequest, context: grpc.ServicerContext) -> pb.OffloadResponse:
        self._own(request.pool_id, context)
        r = self.service.offload(
            request.request_id, request.pool_id, list(request.keys), list(request.device_pages), request.ready_event
        )
        return pb.OffloadResponse(statuses=convert.statuses_to_pb(r.statuses), bytes_copied=r.bytes_copied)

    @mapped_errors
    def Reload(self, request: pb.ReloadRequest, context: grpc.ServicerContext) -> pb.ReloadResponse:
        self._own(request.pool_id, context)
        r = self.service.reload(
            request.request_id,
            request.pool_id,
            list(request.keys),
            list(request.device_pages),
            layerwise=request.layerwise,
        )
        return pb.ReloadResponse(
            statuses=convert.statuses_to_pb(r.statuses),
            op_id=r.op_id,
            done=r.done,
            bytes_copied=r.bytes_copied,
            progress_slot=r.progress_slot,
            progress_generation=r.progress_generation,
            progress_words=r.progress_words,
            event_slot=r.event_slot,
            event_layers=r.event_layers,
        )

    @mapped_errors
    def BeginCopy(self, request: pb.BeginCopyRequest, context: grpc.ServicerContext) -> pb.BeginCopyResponse:
        self._own(request.pool_id, context)
        g = self.service.begin_copy(request.request_id, request.pool_id, list(request.keys), offload=request.offload)
        return pb.BeginCopyResponse(
            statuses=convert.statuses_to_pb(g.statuses),
            host_pages=list(g.host_pages),
            grant_id=g.grant_id,
            expires_in=_duration(g.expires_s),
        )

    @mapped_errors
    def EndCopy(self, request: pb.EndCopyRequest, context: grpc.ServicerContext) -> pb.EndCopyResponse:
        self._own(request.pool_id, context)
        pages = self.service.end_copy(
            request.request_id,
            request.pool_id,
            request.grant_id,
            commit=request.commit,
            copy_seconds=request.copy_seconds,
        )
        return pb.EndCopyResponse(pages=pages)

    @mapped_errors
    def Prefetch(self, request: pb.PrefetchRequest, context: grpc.ServicerContext) -> pb.PrefetchResponse:
        self._own(request.pool_id, context)
        r = self.service.prefetch(request.request_id, request.pool_id, list(request.keys), request.policy)
        return pb.PrefetchResponse(
            statuses=convert.statuses_to_pb(r.statuses), op_id=r.op_id, done=r.done, timed_out=r.timed_out
        )

    @mapped_errors
    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        self._own(request.pool_id, context)
        r = self.service.evict(request.request_id, request.pool_id, list(request.keys), request.num_pages)
        return pb.EvictResponse(statuses=convert.statuses_to_pb(r.statuses), pages_freed=r.pages_freed)

    @mapped_errors
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        self._own(request.pool_id, context)
        return convert.lookup_to_pb(self.service.lookup(request.pool_id, list(request.keys)))

    @mapped_errors
    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        self._own(request.pool_id, context)
        statuses = self.service.pin(request.request_id, request.pool_id, list(request.keys))
        return pb.PinResponse(statuses=convert.statuses_to_pb(statuses))

    @mapped_errors
    def Unpin(self, request: pb.UnpinRequest, context: grpc.ServicerContext) -> pb.UnpinResponse:
        self._own(request.pool_id, context)
        statuses = self.service.unpin(request.request_id, request.pool_id, list(request.keys))
        return pb.UnpinResponse(statuses=convert.statuses_to_pb(statuses))

    @mapped_errors
    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        if request.pool_id:
            self._own(request.pool_id, context)
        else:
            self._admin(context)
        pools = self.service.stats(request.pool_id)
        return pb.GetStatsResponse(
            pools=[convert.stats_to_pb(s) for s in pools], ops_in_flight=sum(s.ops_in_flight for s in pools)
        )

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchEvent]:
        try:
            self._own(request.pool_id, context)
            self._take_stream(f"Watch of {request.op_id!r}", events=False)
        except Exception as exc:
            abort_for(exc, context)
        try:
            try:
                events = self.service.watch(request.pool_id, request.op_id, cancelled=lambda: not context.is_active())
            except Exception as exc:
                abort_for(exc, context)
            for event in events:
                yield convert.event_to_pb(request.op_id, event)
        finally:
            self.streams.give_back(events=False)

    def _take_stream(self, what: str, *, events: bool) -> None:
        """A slot for a stream that holds an RPC thread until it ends; raises Exhausted
        (RESOURCE_EXHAUSTED) when none is left for it."""
        if not self.streams.take(events=events):
            raise Exhausted(self.streams.refusal(what))

    def SubscribeEvents(
        self, request: pb.SubscribeEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.EventBatch]:
        try:
            self._admin(context, "KV events")
            self._take_stream("SubscribeEvents", events=True)
        except Exception as exc:
            abort_for(exc, context)
        try:
            try:
                namespace = None if request.all_namespaces else request.namespace
                sub = self.service.subscribe(namespace, snapshot=not request.skip_snapshot)
            except Exception as exc:
                abort_for(exc, context)
            yield from self._follow(sub, context)
        finally:
            self.streams.give_back(events=True)

    def _follow(self, sub: Subscription, context: grpc.ServicerContext) -> Iterator[pb.EventBatch]:
        context.add_callback(sub.close)  # the client went away: stop queueing for it
        try:
            while context.is_active():
                if self._ending.is_set():  # subscribed as the server began to stop
                    sub.close()
                batch = sub.next_batch(timeout=0.25)
                if batch is not None:
                    yield convert.event_batch_to_pb(batch)
                elif sub.closed:
                    return
        finally:
            sub.close()


def _metadata(context: grpc.ServicerContext, name: str) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value if isinstance(value, str) else value.decode()
    return ""


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d
