"""The gRPC sidecar in-process (create_server on a temporary socket): status codes, auth,
socket mode, health, reflection, idempotent retries over the wire, Watch, leases."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import eventually
from sidecar_util import CONFIG_PATH, SecretStub, filled_device, keys_for, mimo_full, shm_exists
from sidecar_util import start_in_process as start

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.geometry import KVGeometry
from hicache.memory import FdStore
from hicache.rpc import convert
from hicache.rpc.generated import hicache_pb2 as pb
from hicache.rpc.generated import hicache_pb2_grpc as pb_grpc
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.service import HiCacheService
from server import HiCacheServer, ServerConfig, create_server, parse_args

Code = grpc.StatusCode


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def served(sockdir: str) -> Iterator[tuple[HiCacheServer, str]]:
    srv, address = start(sockdir, max_batch=64)
    yield srv, address
    srv.stop(0)


def rpc_error(fn) -> HiCacheRpcError:
    with pytest.raises(HiCacheRpcError) as exc:
        fn()
    return exc.value


def test_socket_is_0600_and_health_and_reflection_answer(served):
    srv, address = served
    path = address.removeprefix("unix://")
    assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="hicache.v1.HiCache"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert "hicache.v1.HiCache" in names and "grpc.health.v1.Health" in names


def test_client_offload_layerwise_reload_via_watch(served):
    _, address = served
    dev = filled_device(8)
    with HiCacheClient(address, timeout=30) as client:
        client.register(dev, namespace="tenant-a", model_id="mimo")
        keys = client.page_keys(torch.arange(3 * 16 + 5).numpy())
        assert len(keys) == 3
        assert client.offload(keys, [0, 1, 2]).statuses == (KeyStatus.STORED,) * 3
        src = [dev.read_page(p).clone() for p in (0, 1, 2)]
        handle = client.reload([*keys, b"\0" * 32], [5, 6, 7, 4], layerwise=True)
        assert handle.statuses == (KeyStatus.LOADED,) * 3 + (KeyStatus.NOT_FOUND,)
        for layer in range(handle.layer_num):
            handle.wait_layer(layer, timeout=30)
        handle.wait(timeout=30)
        assert handle.done()
        assert all(torch.equal(a, dev.read_page(p)) for a, p in zip(src, (5, 6, 7), strict=True))
        with pytest.raises(ValueError, match="layer 9"):
            handle.wait_layer(9)
        assert client.lookup(keys).prefix_length == 3
        assert client.pin(keys[:1]) == (KeyStatus.PINNED,)
        assert client.evict(keys[:2]).statuses == (KeyStatus.BUSY, KeyStatus.EVICTED)
        assert client.unpin(keys[:1]) == (KeyStatus.UNPINNED,)
        assert client.prefetch(keys[:2]).statuses == (KeyStatus.RESIDENT, KeyStatus.MISSING)
        stats = client.stats()[0]
        assert stats.used_pages == 2 and stats.namespace == "tenant-a" and stats.reload_bytes > 0
    dev.close()


def test_status_codes_name_the_offending_value(served):
    srv, address = served
    dev = filled_device(8)
    client = HiCacheClient(address, timeout=30)
    client.register(dev)
    keys = keys_for(3)
    client.offload(keys[:1], [0])
    cases = [
        (lambda: client.offload(keys[1:3], [1, 8]), Code.INVALID_ARGUMENT, "page 8 out of range"),
        (lambda: client.offload(keys[1:3], [1, 1]), Code.INVALID_ARGUMENT, "duplicate page 1"),
        (lambda: client.reload(keys[:1], [0, 1]), Code.INVALID_ARGUMENT, "1 keys but 2 device_pages"),
        (lambda: client.lookup([b"abc"]), Code.INVALID_ARGUMENT, "keys[0] must be a 32-byte"),
        (lambda: client.lookup(keys_for(65)), Code.INVALID_ARGUMENT, "batch of 65 keys exceeds the limit of 64"),
        (lambda: client.evict(), Code.INVALID_ARGUMENT, "either keys or num_pages"),
    ]
    for call, code, needle in cases:
        err = rpc_error(call)
        assert err.code == code and needle in err.details, (err.code, err.details)
        srv.service.check_integrity()
    assert client.lookup(keys).tiers == (Tier.HOST, Tier.NONE, Tier.NONE)
    stub = pb_grpc.HiCacheStub(grpc.insecure_channel(address))
    mine = (("x-hicache-pool-secret", client._pool(None).secret),)
    for call in (
        lambda: stub.Lookup(pb.LookupRequest(pool_id="pool-nope")),
        lambda: stub.Watch(pb.WatchRequest(pool_id=client._default, op_id="op-nope"), metadata=mine).next(),
    ):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == Code.NOT_FOUND and "nope" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        stub.RegisterPool(pb.RegisterPoolRequest(request_id="r"))
    assert exc.value.code() == Code.INVALID_ARGUMENT and "geometry" in exc.value.details()
    client.close()
    dev.close()


def test_geometry_mismatch_and_no_space_and_shutdown_codes(sockdir):
    srv, address = start(sockdir, max_pools=1)
    g = mimo_full()
    wrong = filled_device(4, geometry=KVGeometry(**{**g.to_dict(), "v_head_dim": 192}))
    right = filled_device(4)
    client = HiCacheClient(address, timeout=30)
    err = rpc_error(lambda: client.register(wrong))
    assert err.code == Code.INVALID_ARGUMENT and "v_head_dim (engine 192, sidecar 128)" in err.details
    client.register(right)
    err = rpc_error(lambda: client.register(right))
    assert err.code == Code.RESOURCE_EXHAUSTED and "limit is 1" in err.details
    srv.service.close()
    err = rpc_error(lambda: client.register(right))
    assert err.code == Code.FAILED_PRECONDITION and "shut down" in err.details
    srv.stop(0)
    assert not os.path.exists(address.removeprefix("unix://"))
    wrong.close()
    right.close()


def test_auth_on_and_off(sockdir):
    srv, address = start(sockdir, token="s3cret")
    dev = filled_device(4)
    for token, needle in ((None, "missing token"), ("guess", "wrong token")):
        err = rpc_error(lambda t=token: HiCacheClient(address, token=t, timeout=30).register(dev))
        assert err.code == Code.UNAUTHENTICATED and needle in err.details
    with grpc.insecure_channel(address) as ch:  # health checks need no token
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == 1
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.HiCacheStub(ch).Watch(pb.WatchRequest(pool_id="p", op_id="o")).next()
        assert exc.value.code() == Code.UNAUTHENTICATED
    assert srv.service.pool_ids == []
    with HiCacheClient(address, token="s3cret", timeout=30) as client:
        client.register(dev)
        assert client.stats()[0].device_pages == 4
    srv.stop(0)
    srv, address = start(sockdir)  # auth off: no token needed
    with HiCacheClient(address, timeout=30) as client:
        client.register(dev)
    srv.stop(0)
    dev.close()


def test_without_the_token_an_unknown_method_is_unimplemented_and_adds_no_metric(sockdir):
    import urllib.request

    config = ServerConfig(socket=os.path.join(sockdir, "hc.sock"), token="s3cret", metrics_port=0)
    srv, address = create_server(config)
    try:
        with grpc.insecure_channel(address) as ch:
            for i in range(3):
                with pytest.raises(grpc.RpcError) as exc:
                    ch.unary_unary(f"/evil.Service/Method{i}")(b"", timeout=30)
                assert exc.value.code() == Code.UNIMPLEMENTED  # before: UNAUTHENTICATED, and a new series each
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.HiCacheStub(ch).GetStats(pb.GetStatsRequest(), timeout=30)
            assert exc.value.code() == Code.UNAUTHENTICATED  # a real method still needs the token
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
        assert "evil" not in body and "Method0" not in body
    finally:
        srv.stop(0)


def test_stop_leaves_no_thread_and_no_file_behind(sockdir):
    import threading

    before = set(threading.enumerate())
    srv, address = start(sockdir)
    dev = filled_device(4)
    with HiCacheClient(address, timeout=30) as client:  # the RPC threads start with the calls
        client.register(dev)
    srv.stop(0)
    dev.close()
    server_threads = ("hicache-rpc", "hicache-fd-listener", "hicache-reaper", "hicache-health")
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith(server_threads)]
    assert left == [], left  # before: the fd listener (blocked in accept) and the RPC threads
    assert os.listdir(sockdir) == []


def test_a_tcp_address_that_cannot_be_bound_is_one_error_and_leaves_no_socket(sockdir):
    import socket

    sock = os.path.join(sockdir, "hc.sock")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        listen = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(ValueError, match=f"cannot listen on {listen}"):  # before: grpcio's RuntimeError
            create_server(ServerConfig(socket=sock, listen=listen, insecure=True))
    assert not os.path.exists(sock)  # before: left behind
    srv, _ = create_server(ServerConfig(socket=sock))  # and the socket can be served again
    srv.stop(0)


def test_retry_with_same_request_id_is_idempotent(served):
    srv, address = served
    dev = filled_device(8)
    stub = pb_grpc.HiCacheStub(grpc.insecure_channel(address))
    reg = pb.RegisterPoolRequest(
        request_id="reg",
        geometry=convert.geometry_to_pb(dev.geometry),
        device_pages=8,
        device_memory=convert.memory_to_pb(dev.handle),
    )
    first, again = stub.RegisterPool(reg), stub.RegisterPool(reg)
    assert first == again and len(srv.service.pool_ids) == 1  # the same pool, and the same secret
    stub = SecretStub(stub, first.pool_secret)
    req = pb.OffloadRequest(request_id="o-1", pool_id=first.pool_id, keys=keys_for(2), device_pages=[0, 1])
    a, b = stub.Offload(req), stub.Offload(req)
    assert a == b and list(a.statuses) == [pb.KEY_STATUS_STORED] * 2
    stats = stub.GetStats(pb.GetStatsRequest(pool_id=first.pool_id)).pools[0]
    assert stats.offload_bytes == a.bytes_copied and stats.used_pages == 2
    req.device_pages[:] = [2, 3]
    with pytest.raises(grpc.RpcError) as exc:
        stub.Offload(req)
    assert exc.value.code() == Code.INVALID_ARGUMENT and "'o-1' was already used" in exc.value.details()
    dev.close()


def test_silent_client_lease_expires_and_host_memory_is_released(sockdir):
    srv, address = start(sockdir, lease_timeout_s=2.0)
    dev = filled_device(4)
    stub = pb_grpc.HiCacheStub(grpc.insecure_channel(address))
    reg = stub.RegisterPool(
        pb.RegisterPoolRequest(
            request_id="r",
            geometry=convert.geometry_to_pb(dev.geometry),
            device_pages=4,
            device_memory=convert.memory_to_pb(dev.handle),
        )
    )
    assert shm_exists(reg.host_shm_name) and (not reg.progress_shm_name or shm_exists(reg.progress_shm_name))
    for _ in range(600):  # no keepalive: the reaper reclaims it
        if not srv.service.pool_ids:
            break
        time.sleep(0.05)
    assert not srv.service.pool_ids
    assert not shm_exists(reg.host_shm_name) and shm_exists(dev.handle.name)
    assert not reg.progress_shm_name or not shm_exists(reg.progress_shm_name)  # the progress block went too
    srv.stop(0)
    dev.close()


def test_keep_alive_follows_a_restarted_sidecars_shorter_lease(sockdir):
    srv, address = start(sockdir, lease_timeout_s=9.0)
    dev = filled_device(4)
    client = HiCacheClient(address, timeout=5)
    try:
        old = client.register(dev, group="full")  # keep-alive now renews every 3 s
        srv.stop(0)
        srv, _ = start(sockdir, lease_timeout_s=1.0)  # restarted: it forgot the pool, leases for 1 s
        client.forget(old)
        pool = client.register(dev, group="full")
        assert pool.lease_timeout_s == 1.0
        time.sleep(3.5)  # an idle engine: only keep-alive renews the lease
        assert srv.service.pool_ids == [pool.pool_id]
        assert client.lookup(keys_for(1), pool=pool).prefix_length == 0
    finally:
        client.close()
        srv.stop(0)
        dev.close()


def test_a_reload_handle_whose_watch_cannot_start_finishes_failed():
    from hicache.api import TransferResult
    from hicache.client.handles import ReloadHandle

    channel = grpc.insecure_channel("unix:///nonexistent/hc.sock")
    stub = pb_grpc.HiCacheStub(channel)
    channel.close()  # the client was closed: a Watch raises ValueError, not an RpcError
    handle = ReloadHandle(
        TransferResult((), 0, "op-1", False), 4, lambda: stub.Watch(pb.WatchRequest(pool_id="p", op_id="op-1"))
    )
    with pytest.raises(RuntimeError, match="following the reload failed: ValueError"):
        handle.wait(timeout=30)  # it hung (timeout None: for ever) when the watch thread died
    assert handle.done()


def test_the_reaper_closes_fds_that_no_registration_claimed(sockdir):
    # an engine that sent fds and died: no other engine sends or claims fds after it
    service = HiCacheService(ServiceConfig(), fds=FdStore(ttl_s=-1))  # every fd expired at once
    srv, _ = create_server(
        ServerConfig(socket=os.path.join(sockdir, "hc.sock"), service=service.config, reap_interval_s=0.05), service
    )
    r, w = os.pipe()
    try:
        service.fds.add(r)  # what the fd listener does with an fd the engine sent
        eventually(lambda: reader_closed(w), what="the reaper closing the unclaimed fd")
    finally:
        srv.stop(0)
        os.close(w)


def reader_closed(write_end: int) -> bool:
    """Whether the read end of the pipe is closed everywhere (a write fails with EPIPE)."""
    try:
        os.write(write_end, b"x")
    except BrokenPipeError:
        return True
    return False


def test_tcp_listen_needs_token_and_works_with_it(sockdir):
    sock = os.path.join(sockdir, "t.sock")
    with pytest.raises(ValueError, match="without --token"):
        ServerConfig(socket=sock, listen="127.0.0.1:0")
    with pytest.raises(ValueError, match="HOST:PORT"):
        ServerConfig(socket=sock, listen="nope", insecure=True)
    srv, _ = create_server(ServerConfig(socket=sock, listen="127.0.0.1:0", token="tok", admin_token="adm"))
    tcp = srv.addresses[1]
    assert not tcp.endswith(":0")
    with HiCacheClient(tcp, token="tok", timeout=30, admin_token="adm") as client:
        assert client.stats(all_pools=True) == []
    srv.stop(0)


def test_flags_build_the_expected_geometry(sockdir):
    config, level = parse_args(
        ["--socket", os.path.join(sockdir, "x.sock"), "--model-config", str(CONFIG_PATH), "--page-size", "16"]
        + ["--kv-cache-dtype", "bf16", "--hicache-ratio", "3", "--hicache-mem-layout", "page_first"]
    )
    expected = config.service.expected
    assert expected is not None and set(expected) == {"full", "swa"}
    assert expected["full"] == mimo_full() and expected["full"].v_head_dim == 128
    assert config.service.hierarchy.ratio == 3 and config.service.host_layout == "page_first" and level == "INFO"
    assert config.service.hierarchy.storage_backend == "file"  # the server's default tier
    with pytest.raises(ValueError, match="tp_size 3"):
        parse_args(["--model-config", str(CONFIG_PATH), "--tp-size", "3"])


def test_close_fails_fast_when_the_sidecar_is_gone(sockdir):
    srv, address = start(sockdir)
    dev = filled_device(4)
    client = HiCacheClient(address, timeout=30)
    client.register(dev)
    srv.stop(0)
    client.close()  # best effort: no wait for a sidecar that is not coming back
    assert client._pools == {}
    dev.close()
