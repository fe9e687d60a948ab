"""Streams hold an RPC thread each until they end (SubscribeEvents, an operation's Watch, the
health service's Watch): together they may take half of the server's --workers, so unary
calls and health checks always have threads; a refused stream is RESOURCE_EXHAUSTED naming
the limit, and a reload handle that follows its reload through Watch tries again."""

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


def test_stream_slots_are_counted_and_refuse_a_limit_below_one() -> None:
    slots = StreamSlots(2)
    assert slots.take() and slots.take() and not slots.take()
    slots.give_back()
    assert slots.take()
    assert "at most 2 streams at once" in slots.refusal("Watch")
    with pytest.raises(ValueError, match="stream slots must be >= 1, got 0"):
        StreamSlots(0)


@pytest.mark.skipif(not native.available(), reason="a queued layer-wise reload needs the C extension")
def test_streams_share_half_the_workers_and_a_refused_reload_watch_tries_again() -> None:
    d = tempfile.mkdtemp(prefix="hc")
    config = ServerConfig(
        socket=os.path.join(d, "hc.sock"),
        admin_token=ADMIN,
        workers=2,
        grace_s=0,
        service=ServiceConfig(expected=mimo_geometries(), layerwise_inline_bytes=0),
    )
    assert config.max_streams == 1
    srv, address = create_server(config)
    engine = HiCacheClient(address, timeout=30)
    subscriber = HiCacheClient(address, admin_token=ADMIN, timeout=30)
    try:
        dev = filled_device(8, seed=1)
        pool = engine.register(dev)
        keys = keys_for(2, seed=2)
        engine.offload(keys, [0, 1])
        done = engine.reload(keys, [2, 3], layerwise=True)
        done.wait(30)  # an operation the sidecar still knows, to Watch

        def drain() -> None:
            with contextlib.suppress(HiCacheRpcError):  # UNAVAILABLE once its client closes
                for _ in subscriber.events(snapshot=False):
                    pass

        follower = threading.Thread(target=drain, daemon=True)
        follower.start()
        eventually(lambda: srv.service.events.subscribers == 1, what="the event stream")
        with pytest.raises(HiCacheRpcError) as refused:
            next(engine.watch(done.op_id))
        assert refused.value.code.name == "RESOURCE_EXHAUSTED"
        assert f"Watch of {done.op_id!r}: this sidecar serves at most 1 streams at once" in refused.value.details
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as health_refused:
                next(health.Watch(health_pb2.HealthCheckRequest(), timeout=30))
            assert health_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "health Watch: this sidecar serves at most 1" in (health_refused.value.details() or "")
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status  # unary calls still answer
        assert engine.lookup(keys).prefix_length == 2

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
