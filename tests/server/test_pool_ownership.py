"""Pools belong to the client that registered them: another connection can neither see, read
nor change a pool without its secret, and stats of all pools need the admin token."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from sidecar_util import filled_device, keys_for, mimo_geometries

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.rpc.generated import hicache_pb2 as pb
from hicache.rpc.generated import hicache_pb2_grpc as pb_grpc
from hicache.sidecar.config import ServiceConfig
from server import ServerConfig, create_server


@pytest.fixture
def served() -> Iterator[tuple[Any, str]]:
    d = tempfile.mkdtemp(prefix="hc")
    config = ServerConfig(
        socket=os.path.join(d, "hc.sock"), admin_token="adm-1", service=ServiceConfig(expected=mimo_geometries())
    )
    srv, address = create_server(config)
    yield srv, address
    srv.stop(0)
    shutil.rmtree(d, ignore_errors=True)


def denied(call: Callable[[], Any]) -> str:
    with pytest.raises(HiCacheRpcError) as exc:
        call()
    assert exc.value.code.name == "PERMISSION_DENIED", exc.value
    return exc.value.details


def test_another_connection_can_neither_see_read_nor_change_a_pool(served: tuple[Any, str]) -> None:
    srv, address = served
    dev, other_dev = filled_device(8, seed=1), filled_device(8, seed=2)
    owner, intruder = HiCacheClient(address, timeout=20), HiCacheClient(address, timeout=20)
    try:
        pool = owner.register(dev, namespace="tenant-a")
        intruder.register(other_dev, namespace="tenant-b")
        keys = keys_for(2, seed=3)
        assert owner.offload(keys, [0, 1]).statuses == (KeyStatus.STORED,) * 2
        intruder.attach(pool.pool_id, "0" * 32)  # a guessed secret
        for call in (
            lambda: intruder.lookup(keys, pool=pool.pool_id),
            lambda: intruder.pin(keys, pool=pool.pool_id),
            lambda: intruder.unpin(keys, pool=pool.pool_id),
            lambda: intruder.prefetch(keys, pool=pool.pool_id),
            lambda: list(intruder.watch("op-x", pool=pool.pool_id)),
            lambda: intruder.begin_copy(keys, offload=False, pool=pool.pool_id),
            lambda: intruder.end_copy("grant-x", commit=True, pool=pool.pool_id),
        ):
            assert "wrong pool secret" in denied(call)
        stub = pb_grpc.HiCacheStub(grpc.insecure_channel(address))  # no secret at all
        for raw in (
            lambda: stub.Evict(pb.EvictRequest(request_id="e", pool_id=pool.pool_id, keys=keys)),
            lambda: stub.Offload(
                pb.OffloadRequest(request_id="o", pool_id=pool.pool_id, keys=keys, device_pages=[2, 3])
            ),
            lambda: stub.Reload(pb.ReloadRequest(request_id="r", pool_id=pool.pool_id, keys=keys, device_pages=[2, 3])),
            lambda: stub.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id)),
            lambda: stub.KeepAlive(pb.KeepAliveRequest(pool_id=pool.pool_id)),
            lambda: stub.UnregisterPool(pb.UnregisterPoolRequest(request_id="u", pool_id=pool.pool_id)),
            lambda: stub.BeginCopy(pb.BeginCopyRequest(request_id="b", pool_id=pool.pool_id, keys=keys, offload=True)),
            lambda: stub.EndCopy(pb.EndCopyRequest(request_id="c", pool_id=pool.pool_id, grant_id="grant-x")),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                raw()
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "missing pool secret" in exc.value.details()
        # nothing the intruder tried changed the pool
        assert owner.lookup(keys).tiers == (Tier.HOST, Tier.HOST)
        assert owner.stats()[0].used_pages == 2 and owner.stats()[0].pinned_pages == 0
        assert pool.pool_id in srv.service.pool_ids
        # an unknown pool is still NOT_FOUND, so a client can tell a forgotten pool from another's
        with pytest.raises(HiCacheRpcError, match="NOT_FOUND"):
            intruder.lookup(keys, pool="pool-nope")
        # stats of all pools: the admin token only
        assert "missing admin token" in denied(lambda: intruder.stats(all_pools=True))
        wrong = HiCacheClient(address, timeout=20, admin_token="guess")
        assert "wrong admin token" in denied(lambda: wrong.stats(all_pools=True))
        wrong.close()
        with HiCacheClient(address, timeout=20, admin_token="adm-1") as admin:
            assert sorted(s.namespace for s in admin.stats(all_pools=True)) == ["tenant-a", "tenant-b"]
        # handing over the secret is how a pool is shared (a vLLM scheduler and its workers)
        reader = HiCacheClient(address, timeout=20)
        reader.attach(pool.pool_id, pool.secret)
        assert reader.lookup(keys, pool=pool.pool_id).tiers == (Tier.HOST, Tier.HOST)
        reader.close()
    finally:
        owner.close()
        intruder.close()
        dev.close()
        other_dev.close()


def test_without_an_admin_token_no_one_lists_every_pool(tmp_path: Any) -> None:
    srv, address = create_server(ServerConfig(socket=str(tmp_path / "hc.sock"), service=ServiceConfig()))
    try:
        with HiCacheClient(address, timeout=20, admin_token="anything") as client:
            assert "need the sidecar's --admin-token" in denied(lambda: client.stats(all_pools=True))
    finally:
        srv.stop(0)


def test_attach_needs_an_id_and_a_secret(served: tuple[Any, str]) -> None:
    _, address = served
    with HiCacheClient(address, timeout=20) as client:
        for pool_id, secret in (("", "s"), ("pool-1", ""), ("pool-1", None)):
            with pytest.raises(ValueError, match="attach needs a pool id and its secret"):
                client.attach(pool_id, secret)  # type: ignore[arg-type]


def test_pool_takes_what_register_returned_or_its_id(served: tuple[Any, str]) -> None:
    _, address = served
    dev_a, dev_b = filled_device(4, seed=1), filled_device(4, seed=2)
    with HiCacheClient(address, timeout=20) as client:
        a = client.register(dev_a, namespace="a")
        b = client.register(dev_b, namespace="b")  # now the default
        keys = keys_for(1, seed=9)
        assert client.offload(keys, [0], pool=a).statuses == (KeyStatus.STORED,)
        assert client.lookup(keys, pool=a).tiers == (Tier.HOST,) == client.lookup(keys, pool=a.pool_id).tiers
        assert client.lookup(keys).tiers == (Tier.NONE,)  # the default pool is b
        assert client.stats(pool=a)[0].namespace == "a" and client.stats(pool=b.pool_id)[0].namespace == "b"
    dev_a.close()
    dev_b.close()


def test_a_retried_unregister_is_still_answered_once_the_pool_is_gone(served: tuple[Any, str]) -> None:
    _, address = served
    dev = filled_device(4)
    stub = pb_grpc.HiCacheStub(grpc.insecure_channel(address))
    with HiCacheClient(address, timeout=20) as client:
        pool = client.register(dev)
        request = pb.UnregisterPoolRequest(request_id="u-1", pool_id=pool.pool_id)
        mine = (("x-hicache-pool-secret", pool.secret),)
        stub.UnregisterPool(request, metadata=mine)
        stub.UnregisterPool(request, metadata=mine)  # the answer was lost: the same id again
        with pytest.raises(grpc.RpcError) as exc:  # a new request for the gone pool
            stub.UnregisterPool(pb.UnregisterPoolRequest(request_id="u-2", pool_id=pool.pool_id), metadata=mine)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        client._pools.clear()  # it is gone already: nothing for close() to unregister
    dev.close()
