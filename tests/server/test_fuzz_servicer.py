"""Hostile input over the wire: hypothesis drives a real in-process sidecar (create_server on a
temporary socket) with random and malformed requests. Every bad request gets a status
code that names a caller's mistake and a message, the server stays up, and every pool's
check_integrity() holds after each example."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sidecar_util import SecretStub, filled_device, keys
from tier_helpers import GEOMETRIES

from hicache.cache.config import HiCacheConfig
from hicache.pools import DeviceKVPool
from hicache.rpc import convert
from hicache.rpc.generated import hicache_pb2 as pb
from hicache.rpc.generated import hicache_pb2_grpc as pb_grpc
from hicache.sidecar.config import ServiceConfig
from server import HiCacheServer, ServerConfig, create_server

Code = grpc.StatusCode
CALLER_MISTAKES = {
    Code.INVALID_ARGUMENT,
    Code.NOT_FOUND,
    Code.PERMISSION_DENIED,
    Code.FAILED_PRECONDITION,
    Code.RESOURCE_EXHAUSTED,
}
MAX_BATCH = 64
MAX_MESSAGE = 1 << 20
G = GEOMETRIES["mimo_kv"]
FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass
class Sidecar:
    server: HiCacheServer
    channel: grpc.Channel
    stub: pb_grpc.HiCacheStub
    dev: DeviceKVPool
    pool_id: str
    keys: list[bytes]

    def check(self) -> None:
        """The server is up and every pool is consistent."""
        self.server.service.check_integrity()
        health = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    d = tempfile.mkdtemp(prefix="hc")
    hierarchy = HiCacheConfig(storage_backend="file", extra_config={"dir": os.path.join(d, "tier")})
    service = ServiceConfig(hierarchy=hierarchy, max_batch=MAX_BATCH, max_pools=8)  # any valid geometry
    srv, address = create_server(
        ServerConfig(socket=os.path.join(d, "hc.sock"), service=service, max_message_bytes=MAX_MESSAGE)
    )
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 * MAX_MESSAGE)])
    stub = pb_grpc.HiCacheStub(channel)
    dev = filled_device(16, geometry=G)
    reg = stub.RegisterPool(register_request(dev, "setup"), timeout=30)
    stub = SecretStub(stub, reg.pool_secret)  # type: ignore[assignment]
    ks = keys(8)
    stub.Offload(pb.OffloadRequest(request_id="seed", pool_id=reg.pool_id, keys=ks[:4], device_pages=range(4)))
    yield Sidecar(srv, channel, stub, dev, reg.pool_id, ks)
    srv.stop(0)
    channel.close()
    dev.close()
    shutil.rmtree(d, ignore_errors=True)


def register_request(dev: DeviceKVPool, request_id: str, **fields: Any) -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(
        request_id=request_id,
        geometry=convert.geometry_to_pb(dev.geometry),
        device_pages=dev.num_pages,
        device_memory=convert.memory_to_pb(dev.handle),
        model_id="fuzz/model@1",
        **fields,
    )


def expect_mistake_or_ok(call: Any) -> Any:
    """Run call(); a failure must carry a caller-mistake code and a message (never INTERNAL)."""
    try:
        return call()
    except grpc.RpcError as exc:
        assert exc.code() in CALLER_MISTAKES, (exc.code(), exc.details())
        assert exc.details(), exc.code()
        return None


U64 = st.integers(0, 2**64 - 1)
request_ids = st.text(max_size=8)


def key_lists(sc_keys: list[bytes]) -> st.SearchStrategy[list[bytes]]:
    one = st.one_of(st.sampled_from(sc_keys), st.binary(max_size=40), st.just(b""))
    return st.one_of(st.lists(one, max_size=8), st.lists(st.sampled_from(sc_keys), min_size=60, max_size=70))


def page_lists() -> st.SearchStrategy[list[int]]:
    return st.lists(st.one_of(st.integers(0, 17), U64), max_size=10)


@given(data=st.data())
@FUZZ
def test_random_pool_calls_get_a_status_and_leave_the_pool_consistent(sidecar, data):
    sc = sidecar
    pool_id = data.draw(st.one_of(st.just(sc.pool_id), st.text(max_size=24)), label="pool_id")
    ks = data.draw(key_lists(sc.keys), label="keys")
    pages = data.draw(st.one_of(st.just(list(range(len(ks)))), page_lists()), label="device_pages")
    rid = data.draw(request_ids, label="request_id")
    method = data.draw(st.sampled_from(["Offload", "Reload", "Prefetch", "Evict", "Lookup", "Pin", "Unpin"]))
    requests = {
        "Offload": lambda: pb.OffloadRequest(request_id=rid, pool_id=pool_id, keys=ks, device_pages=pages),
        "Reload": lambda: pb.ReloadRequest(
            request_id=rid, pool_id=pool_id, keys=ks, device_pages=pages, layerwise=data.draw(st.booleans())
        ),
        "Prefetch": lambda: pb.PrefetchRequest(
            request_id=rid, pool_id=pool_id, keys=ks, policy=data.draw(st.sampled_from(["", "best_effort", "x"]))
        ),
        "Evict": lambda: pb.EvictRequest(request_id=rid, pool_id=pool_id, keys=ks, num_pages=data.draw(U64)),
        "Lookup": lambda: pb.LookupRequest(pool_id=pool_id, keys=ks),
        "Pin": lambda: pb.PinRequest(request_id=rid, pool_id=pool_id, keys=ks),
        "Unpin": lambda: pb.UnpinRequest(request_id=rid, pool_id=pool_id, keys=ks),
    }
    request = requests[method]()
    expect_mistake_or_ok(lambda: getattr(sc.stub, method)(request, timeout=30))
    sc.check()


geometry_fields = st.fixed_dictionaries(
    {
        "attention": st.sampled_from(["mha", "mla", "", "gqa"]),
        "layer_num": st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)),
        "head_num": st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1)),
        "head_dim": st.one_of(st.integers(0, 256), st.integers(0, 2**32 - 1)),
        "v_head_dim": st.one_of(st.integers(0, 256), st.integers(0, 2**32 - 1)),
        "kv_lora_rank": st.sampled_from([0, 512, 2**32 - 1]),
        "qk_rope_head_dim": st.sampled_from([0, 64, 2**32 - 1]),
        "page_size": st.one_of(st.integers(0, 16), st.integers(0, 2**32 - 1)),
        "dtype": st.sampled_from(["bfloat16", "float16", "fp4_e2m1", "int3", ""]),
        "layer_ids": st.lists(st.integers(0, 2**32 - 1), max_size=4),
    }
)


@given(data=st.data())
@FUZZ
def test_random_registrations_are_refused_or_registered_never_internal(sidecar, data):
    sc = sidecar
    geometry = data.draw(
        st.one_of(st.just(convert.geometry_to_pb(sc.dev.geometry)), geometry_fields.map(lambda d: pb.Geometry(**d)))
    )
    names = st.sampled_from([sc.dev.handle.name, "", ".", "..", "../../etc/passwd", "hicache-nope", "link"])
    memory = pb.MemoryHandle(
        kind=data.draw(st.sampled_from(["shm", "cuda_ipc", "", "rdma"])),
        nbytes=data.draw(st.one_of(st.just(sc.dev.nbytes), U64)),
        shm_name=data.draw(st.one_of(names, st.text(max_size=12))),
        cuda_ipc_handle=data.draw(st.binary(max_size=80)),
        offset=data.draw(st.one_of(st.just(0), U64)),
        cuda_device=data.draw(st.integers(-(2**31), 2**31 - 1)),
        proof=data.draw(st.one_of(st.just(sc.dev.handle.proof), st.text(max_size=40))),
    )
    request = pb.RegisterPoolRequest(
        request_id=data.draw(request_ids),
        group=data.draw(st.sampled_from(["", "full", "swa", "nope"])),
        geometry=geometry,
        device_pages=data.draw(st.one_of(st.just(sc.dev.num_pages), U64)),
        device_memory=memory,
        namespace=data.draw(st.text(max_size=8)),
        model_id=data.draw(st.sampled_from(["", "m@1"])),
        key_hash=data.draw(st.sampled_from(["", "sha256", "xxh128", "md5"])),
    )
    reply = expect_mistake_or_ok(lambda: sc.stub.RegisterPool(request, timeout=30))
    if reply is not None:  # a valid registration: give it back so the pool limit is not reached
        sc.stub.UnregisterPool(
            pb.UnregisterPoolRequest(request_id="u-" + reply.pool_id, pool_id=reply.pool_id),
            metadata=(("x-hicache-pool-secret", reply.pool_secret),),
        )
    sc.check()


METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["HiCache"].methods]


@given(method=st.sampled_from(METHODS), raw=st.binary(max_size=300))
@FUZZ
def test_random_bytes_on_every_method(sidecar, method, raw):
    sc = sidecar
    path = f"/hicache.v1.HiCache/{method}"
    if method == "Watch":
        call = sc.channel.unary_stream(path, request_serializer=bytes, response_deserializer=bytes)
        expect_mistake_or_ok(lambda: list(call(raw, timeout=30)))
    else:
        call = sc.channel.unary_unary(path, request_serializer=bytes, response_deserializer=bytes)
        expect_mistake_or_ok(lambda: call(raw, timeout=30))
    sc.check()


def raw_call(sc: Sidecar, method: str, raw: bytes) -> grpc.RpcError:
    call = sc.channel.unary_unary(
        f"/hicache.v1.HiCache/{method}", request_serializer=bytes, response_deserializer=bytes
    )
    with pytest.raises(grpc.RpcError) as exc:
        call(raw, timeout=30)
    return exc.value


def test_non_utf8_namespace_is_invalid_argument(sidecar):
    """protobuf in Python refuses to build such a message, so append the field by hand:
    field 6 (namespace), wire type 2, 3 bytes that are not UTF-8."""
    sc = sidecar
    with pytest.raises(ValueError):
        pb.RegisterPoolRequest(namespace=b"\xff\xfe\xfd")  # type: ignore[arg-type]
    raw = register_request(sc.dev, "utf8").SerializeToString() + bytes([6 << 3 | 2, 3, 0xFF, 0xFE, 0xFD])
    err = raw_call(sc, "RegisterPool", raw)
    assert err.code() == Code.INVALID_ARGUMENT and "RegisterPool: the request does not decode" in err.details()
    lookup = pb.LookupRequest(keys=sc.keys[:1]).SerializeToString() + bytes([1 << 3 | 2, 2, 0xC3, 0x28])
    err = raw_call(sc, "Lookup", lookup)  # pool_id: a truncated 2-byte sequence
    assert err.code() == Code.INVALID_ARGUMENT
    assert len(sc.server.service.pool_ids) == 1
    sc.check()


def test_messages_over_the_size_limit_are_refused(sidecar):
    sc = sidecar
    huge = pb.LookupRequest(pool_id=sc.pool_id, keys=[os.urandom(32) for _ in range(MAX_MESSAGE // 32 + 10)])
    with pytest.raises(grpc.RpcError) as exc:
        sc.stub.Lookup(huge, timeout=30)
    assert exc.value.code() == Code.RESOURCE_EXHAUSTED and "larger than max" in exc.value.details()
    sc.check()


def test_batch_edges(sidecar):
    sc = sidecar
    assert sc.stub.Lookup(pb.LookupRequest(pool_id=sc.pool_id), timeout=30).prefix_length == 0  # empty batch
    empty = pb.OffloadRequest(request_id="empty", pool_id=sc.pool_id)
    assert list(sc.stub.Offload(empty, timeout=30).statuses) == []
    too_many = keys(MAX_BATCH + 1, seed=3)
    with pytest.raises(grpc.RpcError) as exc:
        sc.stub.Lookup(pb.LookupRequest(pool_id=sc.pool_id, keys=too_many), timeout=30)
    assert exc.value.code() == Code.INVALID_ARGUMENT and f"limit of {MAX_BATCH}" in exc.value.details()
    for pages, needle in (([2**63], "out of range"), ([3, 3], "duplicate page 3")):
        req = pb.ReloadRequest(
            request_id=f"r{pages}", pool_id=sc.pool_id, keys=sc.keys[: len(pages)], device_pages=pages
        )
        with pytest.raises(grpc.RpcError) as exc:
            sc.stub.Reload(req, timeout=30)
        assert exc.value.code() == Code.INVALID_ARGUMENT and needle in exc.value.details(), exc.value.details()
    sc.check()


def test_device_memory_must_be_a_plain_shm_file(sidecar):
    """A symlink or a folder in /dev/shm is refused: the sidecar maps only regular files."""
    sc = sidecar
    link = f"hicache-link-{os.getpid()}"
    folder = f"hicache-dir-{os.getpid()}"
    os.symlink(os.path.join("/dev/shm", sc.dev.handle.name), os.path.join("/dev/shm", link))
    os.mkdir(os.path.join("/dev/shm", folder))
    try:
        for name in (link, folder, ".."):
            request = register_request(sc.dev, f"bad-{name}")
            request.device_memory.shm_name = name
            with pytest.raises(grpc.RpcError) as exc:
                sc.stub.RegisterPool(request, timeout=30)
            assert exc.value.code() == Code.INVALID_ARGUMENT, exc.value.details()
            assert name in exc.value.details()
    finally:
        os.unlink(os.path.join("/dev/shm", link))
        os.rmdir(os.path.join("/dev/shm", folder))
    sc.check()
