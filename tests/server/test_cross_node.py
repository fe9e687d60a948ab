"""Two sidecars stand in for two nodes, each with its own host pool, over one real Redis
Cluster: a conversation offloaded on node A is a STORAGE hit on node B and reloads bit-exact
there; another namespace, model, dtype or TP layout on B finds nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import load_config
from helpers import eventually
from sidecar_util import filled_device, keys_for, mimo_full, pages_of

from hicache.api import KeyStatus, Tier
from hicache.cache.config import HiCacheConfig
from hicache.client import HiCacheClient
from hicache.demo.redis_cluster import LocalRedisCluster
from hicache.geometry import model_geometries
from hicache.pools import DeviceKVPool
from hicache.sidecar.config import ServiceConfig
from server import ServerConfig, create_server


@pytest.fixture
def nodes(redis_cluster: LocalRedisCluster) -> Iterator[tuple[str, str]]:
    """Two sidecars (any geometry accepted) over the shared cluster; their addresses."""
    folders, servers, addresses = [], [], []
    for _ in range(2):
        d = tempfile.mkdtemp(prefix="hc")
        hierarchy = HiCacheConfig(storage_backend="redis-cluster", extra_config={"url": redis_cluster.url}, ratio=1.0)
        srv, address = create_server(
            ServerConfig(socket=os.path.join(d, "hc.sock"), service=ServiceConfig(hierarchy=hierarchy))
        )
        folders.append(d)
        servers.append(srv)
        addresses.append(address)
    yield addresses[0], addresses[1]
    for srv, d in zip(servers, folders, strict=True):
        srv.stop(0)
        shutil.rmtree(d, ignore_errors=True)
    redis_cluster.flush()


def until_in_storage(client: HiCacheClient, keys: list[bytes], pool: Any) -> None:
    """Write-through is asynchronous: wait until node B sees all of A's pages in storage."""
    stored = (Tier.STORAGE,) * len(keys)
    eventually(lambda: client.lookup(keys, pool=pool).tiers == stored, 30, "A's pages in storage on B")


def test_a_prefix_offloaded_on_node_a_reloads_bit_exact_on_node_b(nodes: tuple[str, str]) -> None:
    a, b = HiCacheClient(nodes[0], timeout=30), HiCacheClient(nodes[1], timeout=30)
    dev_a, dev_b = filled_device(8, seed=1), DeviceKVPool(mimo_full(), 8)
    pool_a = a.register(dev_a, namespace="tenant", model_id="mimo@1")
    pool_b = b.register(dev_b, namespace="tenant", model_id="mimo@1")
    keys = keys_for(6, seed=7)
    assert a.offload(keys, list(range(6)), pool=pool_a).statuses == (KeyStatus.STORED,) * 6
    until_in_storage(b, keys, pool_b)
    found = b.lookup(keys, pool=pool_b)
    assert found.prefix_length == 6 and set(found.tiers) == {Tier.STORAGE}  # not on B's host: in storage
    fetched = b.prefetch(keys, policy="wait_complete", pool=pool_b)
    assert fetched.statuses == (KeyStatus.FETCHED,) * 6
    r = b.reload(keys, [7, 6, 5, 4, 3, 2], pool=pool_b)
    assert r.statuses == (KeyStatus.LOADED,) * 6
    for got, want in zip(pages_of(dev_b, [7, 6, 5, 4, 3, 2]), pages_of(dev_a, list(range(6))), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    a.close()
    b.close()


def test_another_namespace_model_dtype_or_tp_layout_on_node_b_finds_nothing(nodes: tuple[str, str]) -> None:
    a, b = HiCacheClient(nodes[0], timeout=30), HiCacheClient(nodes[1], timeout=30)
    pool_a = a.register(filled_device(8, seed=2), namespace="tenant", model_id="mimo@1")
    keys = keys_for(4, seed=8)
    a.offload(keys, [0, 1, 2, 3], pool=pool_a)
    same = b.register(DeviceKVPool(mimo_full(), 8), namespace="tenant", model_id="mimo@1")
    until_in_storage(b, keys, same)
    config = load_config("mimo_v2_flash")
    fp8 = model_geometries(config, tp_size=1, page_size=mimo_full().page_size, dtype="fp8_e4m3")["full"]
    tp2 = model_geometries(config, tp_size=2, page_size=mimo_full().page_size, dtype="bfloat16")["full"]
    others = {
        "namespace": b.register(DeviceKVPool(mimo_full(), 8), namespace="other", model_id="mimo@1"),
        "model": b.register(DeviceKVPool(mimo_full(), 8), namespace="tenant", model_id="mimo@2"),
        "dtype": b.register(DeviceKVPool(fp8, 8), namespace="tenant", model_id="mimo@1"),
        "tp layout": b.register(DeviceKVPool(tp2, 8), namespace="tenant", model_id="mimo@1", tp_rank=0, tp_size=2),
    }
    for what, pool in others.items():
        found = b.lookup(keys, pool=pool)
        assert found.prefix_length == 0 and set(found.tiers) == {Tier.NONE}, what
    a.close()
    b.close()
