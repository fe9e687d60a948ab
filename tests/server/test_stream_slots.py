"""Streams hold an RPC thread each until they end (SubscribeEvents, an operation's Watch): KV-
event streams may take half of the server's --workers and streams in all every worker but a
quarter, so event subscribers never starve Watch and unary calls always have threads; a
refused stream is RESOURCE_EXHAUSTED naming the limits, and a reload handle that follows
its reload through Watch tries again."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import eventually
from sidecar_util import filled_device, keys_for, mimo_geometries

from hicache.api import TransferResult
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.client.handles import ReloadHandle
from hicache.rpc.generated import hicache_pb2 as pb
from hicache.sidecar.config import ServiceConfig
from hicache.transfer import native
from server import ServerConfig, create_server
from server.streams import StreamSlots

ADMIN = "adm-streams"


def test_stream_slots_keep_event_streams_to_their_share_and_refuse_bad_limits() -> None:
    slots = StreamSlots(3, 2)
    assert slots.take(events=True) and slots.take(events=True) and not slots.take(events=True)
    assert slots.take(events=False) and not slots.take(events=False)  # the third slot, then none
    slots.give_back(events=True)
    assert slots.take(events=False)  # the slot an event stream gave back serves a Watch
    assert not slots.take(events=True)  # an event slot is free, but no slot in all
    slots.give_back(events=False)
    assert slots.take(events=True)  # the refusal above kept no event slot
    assert "at most 2 KV-event streams and 3 streams in all" in slots.refusal("Watch")
    for total, events in ((2, 3), (1, 0)):
        with pytest.raises(ValueError, match="stream slots need 1 <= events <= total"):
            StreamSlots(total, events)


def served(workers: int) -> tuple[Any, str, str]:
    d = tempfile.mkdtemp(prefix="hc")
    config = ServerConfig(
        socket=os.path.join(d, "hc.sock"),
        admin_token=ADMIN,
        workers=workers,
        grace_s=0,
        service=ServiceConfig(expected=mimo_geometries(), layerwise_inline_bytes=0),
    )
    srv, address = create_server(config)
    return srv, address, d


def subscribe(client: HiCacheClient) -> threading.Thread:
    def drain() -> None:
        with contextlib.suppress(HiCacheRpcError):  # UNAVAILABLE once its client closes
            for _ in client.events(snapshot=False):
                pass

    follower = threading.Thread(target=drain, daemon=True)
    follower.start()
    return follower


def finished_reload(engine: HiCacheClient) -> tuple[Any, Any]:
    """A pool, and a layer-wise reload the sidecar still knows (to Watch)."""
    pool = engine.register(filled_device(8, seed=1))
    keys = keys_for(2, seed=2)
    engine.offload(keys, [0, 1])
    done = engine.reload(keys, [2, 3], layerwise=True)
    done.wait(30)
    return pool, done


@pytest.mark.skipif(not native.available(), reason="a queued layer-wise reload needs the C extension")
def test_event_subscribers_never_take_the_threads_watch_and_health_need() -> None:
    srv, address, d = served(4)  # event streams: 2; streams in all: 3
    engine = HiCacheClient(address, timeout=30)
    subscribers = [HiCacheClient(address, admin_token=ADMIN, timeout=30) for _ in range(3)]
    try:
        _, done = finished_reload(engine)
        for client in subscribers[:2]:
            subscribe(client)
        eventually(lambda: srv.service.events.subscribers == 2, what="two event streams")
        with pytest.raises(HiCacheRpcError) as refused:
            next(subscribers[2].events(snapshot=False))
        assert refused.value.code.name == "RESOURCE_EXHAUSTED"
        assert "SubscribeEvents: this sidecar serves at most 2 KV-event streams and 3 streams in all" in (
            refused.value.details
        )
        assert [e.kind for e in engine.watch(done.op_id)][-1] == "done"  # Watch still has its slot
        with grpc.insecure_channel(address) as channel:  # the health service's Watch holds no slot
            health = health_pb2_grpc.HealthStub(channel)
            watching = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watching).status in (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            watching.cancel()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
        assert engine.lookup(keys_for(2, seed=2)).prefix_length == 2
        subscribers[0].close()  # ends its stream: the server takes a new one
        eventually(lambda: srv.service.events.subscribers == 1, what="the first stream's end")
        subscribe(subscribers[2])
        eventually(lambda: srv.service.events.subscribers == 2, what="a new stream")
    finally:
        srv.stop(0)
        engine.close()
        for client in subscribers:
            client.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(not native.available(), reason="a queued layer-wise reload needs the C extension")
def test_a_refused_reload_watch_tries_again_until_a_slot_is_free() -> None:
    srv, address, d = served(2)  # one stream in all
    engine = HiCacheClient(address, timeout=30)
    subscriber = HiCacheClient(address, admin_token=ADMIN, timeout=30)
    try:
        pool, done = finished_reload(engine)
        follower = subscribe(subscriber)
        eventually(lambda: srv.service.events.subscribers == 1, what="the event stream")
        with pytest.raises(HiCacheRpcError) as refused:
            next(engine.watch(done.op_id))
        assert refused.value.code.name == "RESOURCE_EXHAUSTED"
        assert f"Watch of {done.op_id!r}: this sidecar serves at most 1 KV-event streams and 1 streams" in (
            refused.value.details
        )
        calls: list[int] = []
        request = pb.WatchRequest(pool_id=pool.pool_id, op_id=done.op_id)

        def watch() -> Any:
            calls.append(1)
            return engine._stub.Watch(request, timeout=30, metadata=engine._pool_metadata(pool.pool_id))

        # a handle with no progress slot follows its reload through Watch: refused, it tries again
        handle = ReloadHandle(TransferResult(done.statuses, 0, done.op_id, False), done.layer_num, watch)
        eventually(lambda: len(calls) >= 2, what="a second Watch after the refusal")
        assert not handle.done()
        subscriber.close()  # ends the event stream: its slot is free
        follower.join(30)
        handle.wait(30)
        assert handle.done()
    finally:
        srv.stop(0)
        engine.close()
        subscriber.close()
        shutil.rmtree(d, ignore_errors=True)
