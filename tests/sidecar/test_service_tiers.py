"""The storage hierarchy through the sidecar service: pages leave host memory for the
storage tier and come back bit-exact, for K != V, MLA and fp4 geometries."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from sidecar_util import MODEL, PAGE_SIZE, filled_device, keys, register, service
from tier_helpers import GEOMETRIES, GEOMETRY_NAMES, RedisServer

from hicache.api import KeyStatus, PoolInfo, Tier
from hicache.cache.config import HiCacheConfig

S = KeyStatus


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_offload_evict_reload_from_file_tier(tmp_path, name):
    g = GEOMETRIES[name]
    svc = service(tmp_path)
    dev = filled_device(4, geometry=g)
    info = register(svc, dev)
    ks = keys(4)
    src = [dev.read_page(p).clone() for p in range(4)]
    assert svc.offload("o", info.pool_id, ks, [0, 1, 2, 3]).statuses == (S.STORED,) * 4
    pool = svc.pool(info.pool_id)
    assert pool.cache.flush(30)
    assert svc.evict("e", info.pool_id, num_pages=4).pages_freed == 4
    assert svc.lookup(info.pool_id, ks).tiers == (Tier.STORAGE,) * 4
    dev.flat.zero_()
    r = svc.reload("r", info.pool_id, ks, [3, 2, 1, 0])
    assert r.statuses == (S.LOADED_FROM_STORAGE,) * 4
    assert all(torch.equal(src[i], dev.read_page(3 - i)) for i in range(4))
    stats = svc.stats(info.pool_id)[0]
    assert stats.storage_backend == "file" and stats.storage_healthy
    assert stats.tiers[1].tier == Tier.STORAGE and stats.tiers[1].hits == 4 and stats.tiers[1].pages == 4
    svc.check_integrity()
    svc.close()
    dev.close()


def test_write_back_keeps_pages_the_host_pool_drops(tmp_path):
    svc = service(tmp_path, write_policy="write_back")
    dev = filled_device(8)
    info = register(svc, dev)  # ratio 1: the host pool holds 8 pages
    ks = keys(12)
    src = [dev.read_page(p).clone() for p in range(8)]
    assert svc.offload("a", info.pool_id, ks[:8], list(range(8))).statuses == (S.STORED,) * 8
    dev2 = [dev.read_page(p).clone() for p in range(4)]
    assert svc.offload("b", info.pool_id, ks[8:], [0, 1, 2, 3]).statuses == (S.STORED,) * 4  # evicts 4 LRU
    assert svc.pool(info.pool_id).cache.flush(30)
    tiers = svc.lookup(info.pool_id, ks).tiers
    assert tiers == (Tier.HOST,) * 4 + (Tier.STORAGE,) * 4 + (Tier.HOST,) * 4  # the first chain's tail went
    dev.flat.zero_()
    r = svc.reload("r", info.pool_id, ks[4:8], [4, 5, 6, 7])
    assert r.statuses == (S.LOADED_FROM_STORAGE,) * 4
    assert all(torch.equal(src[4 + i], dev.read_page(4 + i)) for i in range(4))
    assert not any(torch.equal(dev2[0], dev.read_page(p)) for p in range(4))  # zeroed, untouched
    svc.check_integrity()
    svc.close()
    dev.close()


def _stored_then_dropped(tmp_path: Path, policy: str):  # type: ignore[no-untyped-def]
    svc = service(tmp_path, prefetch_policy=policy)
    dev = filled_device(8)
    info = register(svc, dev)
    ks = keys(6)
    svc.offload("o", info.pool_id, ks, list(range(6)))
    assert svc.pool(info.pool_id).cache.flush(30)
    svc.evict("e", info.pool_id, ks[2:])  # the first two stay on host
    return svc, dev, info, ks


def test_prefetch_wait_complete_then_reload_from_host(tmp_path):
    svc, dev, info, ks = _stored_then_dropped(tmp_path, "wait_complete")
    missing = keys(1, seed=9)
    out = svc.prefetch("p", info.pool_id, ks + missing)
    assert out.done and not out.timed_out
    assert out.statuses == (S.RESIDENT,) * 2 + (S.FETCHED,) * 4 + (S.MISSING,)
    events = list(svc.watch(info.pool_id, out.op_id))
    assert events[-1].kind == "done" and events[-1].layers_done == 4 == events[-1].layer_num
    assert svc.reload("r", info.pool_id, ks, list(range(6))).statuses == (S.LOADED,) * 6
    svc.check_integrity()
    svc.close()
    dev.close()


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_prefetch_best_effort_and_timeout(tmp_path, policy):
    svc, dev, info, ks = _stored_then_dropped(tmp_path, policy)
    out = svc.prefetch("p", info.pool_id, ks)
    assert out.op_id.startswith("pf-")
    assert out.statuses[:2] == (S.RESIDENT,) * 2
    assert set(out.statuses[2:]) <= {S.FETCHING, S.FETCHED, S.MISSING}
    events = list(svc.watch(info.pool_id, out.op_id))  # follows the fetch to its end
    assert events[-1].kind in ("done", "failed")
    done = events[-1].layers_done
    r = svc.reload("r", info.pool_id, ks, list(range(6)))  # whatever was not fetched comes from storage now
    assert set(r.statuses) <= {S.LOADED, S.LOADED_FROM_STORAGE}
    assert r.statuses.count(S.LOADED) >= 2 + (done if policy == "best_effort" else 0)
    svc.check_integrity()
    svc.close()
    dev.close()


def test_file_tier_pages_survive_a_sidecar_restart(tmp_path):
    dev = filled_device(4)
    svc = service(tmp_path)
    info = register(svc, dev)
    ks = keys(4)
    src = [dev.read_page(p).clone() for p in range(4)]
    svc.offload("o", info.pool_id, ks, [0, 1, 2, 3])
    svc.close()  # writes what is queued, then releases host memory
    restarted = service(tmp_path)
    info = register(restarted, dev)
    assert restarted.lookup(info.pool_id, ks).tiers == (Tier.STORAGE,) * 4
    dev.flat.zero_()
    assert restarted.reload("r", info.pool_id, ks, [0, 1, 2, 3]).statuses == (S.LOADED_FROM_STORAGE,) * 4
    assert all(torch.equal(src[i], dev.read_page(i)) for i in range(4))
    restarted.close()
    dev.close()


def test_namespaces_and_models_do_not_share_stored_pages(tmp_path):
    dev = filled_device(4)
    svc = service(tmp_path)
    info = register(svc, dev, namespace="tenant-a")
    ks = keys(2)
    svc.offload("o", info.pool_id, ks, [0, 1])
    svc.close()
    other = service(tmp_path)
    info_b = register(other, dev, namespace="tenant-b")
    assert other.lookup(info_b.pool_id, ks).tiers == (Tier.NONE,) * 2
    other.close()
    dev.close()


def test_storage_tier_needs_a_model_id(tmp_path):
    svc = service(tmp_path)
    dev = filled_device(2)
    with pytest.raises(ValueError, match="model_id must name the model and its revision"):
        svc.register("r", geometry=dev.geometry, device_pages=2, device_memory=dev.handle)
    assert svc.pool_ids == []
    svc.close()
    dev.close()


def test_redis_tier_shared_by_two_sidecars(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    try:
        extra = {"url": server.url, "timeout_s": 2.0}
        a, b = service(tmp_path, "redis", extra=extra), service(tmp_path, "redis", extra=dict(extra))
        dev = filled_device(4)
        info_a, info_b = register(a, dev), register(b, dev)
        ks = keys(2)
        src = [dev.read_page(p).clone() for p in (0, 1)]
        a.offload("o", info_a.pool_id, ks, [0, 1])
        assert a.pool(info_a.pool_id).cache.flush(30)
        assert b.lookup(info_b.pool_id, ks).tiers == (Tier.STORAGE,) * 2
        dev.flat.zero_()
        assert b.reload("r", info_b.pool_id, ks, [2, 3]).statuses == (S.LOADED_FROM_STORAGE,) * 2
        assert torch.equal(src[0], dev.read_page(2)) and torch.equal(src[1], dev.read_page(3))
        server.stop()  # Redis gone: host memory still serves, the tier reports unhealthy
        assert b.reload("r2", info_b.pool_id, ks, [0, 1]).statuses == (S.LOADED,) * 2
        assert b.lookup(info_b.pool_id, ks + keys(1, seed=5)).tiers == (Tier.HOST, Tier.HOST, Tier.NONE)
        stats = b.stats(info_b.pool_id)[0]
        assert stats.storage_backend == "redis" and not stats.storage_healthy
        server.start()  # back: a health probe after the backoff reconnects
        for _ in range(400):
            if b.stats(info_b.pool_id)[0].storage_healthy:
                break
            time.sleep(0.05)
        assert b.stats(info_b.pool_id)[0].storage_healthy
        a.close()
        b.close()
        dev.close()
    finally:
        server.stop()


def test_server_flags_configure_the_tier(tmp_path):
    from server.config import parse_args

    extra = json.dumps({"dir": str(tmp_path), "max_bytes": 1 << 30})
    config, _ = parse_args(
        ["--socket", str(tmp_path / "s.sock"), "--hicache-write-policy", "write_back"]
        + ["--hicache-storage-prefetch-policy", "timeout", "--hicache-storage-backend-extra-config", extra]
    )
    h = config.service.hierarchy
    assert (h.storage_backend, h.write_policy, h.prefetch_policy) == ("file", "write_back", "timeout")
    assert h.extra_config["max_bytes"] == 1 << 30
    with pytest.raises(ValueError, match="unknown storage backend 'tape'"):
        parse_args(["--hicache-storage-backend", "tape"])
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_args(["--hicache-storage-backend-extra-config", "{nope"])


def test_page_size_matches_helpers():
    assert PAGE_SIZE == 16 and GEOMETRIES["mimo_kv"].page_size == 4


def test_prefetch_and_watch_over_grpc(tmp_path):
    from sidecar_util import keys_for
    from sidecar_util import start_in_process as start

    from hicache.client import HiCacheClient

    hierarchy = HiCacheConfig(storage_backend="file", extra_config={"dir": str(tmp_path / "tier")})
    srv, address = start(str(tmp_path), hierarchy=hierarchy)
    dev = filled_device(4)
    try:
        with HiCacheClient(address, timeout=30) as client:
            client.register(dev, model_id=MODEL)
            ks = keys_for(3)
            src = [dev.read_page(p).clone() for p in range(3)]
            client.offload(ks, [0, 1, 2])
            client.evict(ks)  # BUSY while a storage write still holds a key: retry until all are gone
            for _ in range(200):
                if client.lookup(ks).tiers == (Tier.STORAGE,) * 3:
                    break
                client.evict([k for k, t in zip(ks, client.lookup(ks).tiers, strict=True) if t == Tier.HOST])
                time.sleep(0.05)
            assert client.lookup(ks).tiers == (Tier.STORAGE,) * 3
            out = client.prefetch(ks, policy="wait_complete")
            assert out.done and out.statuses == (S.FETCHED,) * 3
            events = list(client.watch(out.op_id))
            assert events[-1].kind == "done" and events[-1].layers_done == 3
            assert list(client.watch(out.op_id, no_deadline=True)) == events
            deadlines = []
            watch = client._stub.Watch
            client._stub.Watch = lambda req, **kw: deadlines.append(kw["timeout"]) or watch(req, **kw)
            list(client.watch(out.op_id)), list(client.watch(out.op_id, no_deadline=True))
            assert deadlines == [30, None]
            client._stub.Watch = watch
            dev.flat.zero_()
            assert client.reload(ks, [3, 2, 1]).statuses == (S.LOADED,) * 3
            assert all(torch.equal(src[i], dev.read_page(3 - i)) for i in range(3))
            stats = client.stats()[0]
            assert stats.storage_backend == "file" and stats.tiers[1].pages == 3
    finally:
        srv.stop(0)
        dev.close()


def test_tensor_parallel_ranks_do_not_share_stored_pages(tmp_path):
    """Ranks hold different KV heads under the same page keys: rank 1 must never be served
    rank 0's stored page."""
    dev = filled_device(2)
    svc = service(tmp_path)
    rank0 = svc.register(
        "r0", geometry=dev.geometry, device_pages=2, device_memory=dev.handle, model_id=MODEL, tp_rank=0, tp_size=2
    )
    assert isinstance(rank0, PoolInfo)
    ks = keys(2)
    svc.offload("o", rank0.pool_id, ks, [0, 1])
    assert svc.pool(rank0.pool_id).cache.flush(30)
    rank1 = svc.register(
        "r1", geometry=dev.geometry, device_pages=2, device_memory=dev.handle, model_id=MODEL, tp_rank=1, tp_size=2
    )
    assert isinstance(rank1, PoolInfo)
    assert svc.lookup(rank1.pool_id, ks).tiers == (Tier.NONE,) * 2
    with pytest.raises(ValueError, match="tp_rank must be an int in \\[0, tp_size=2\\), got 2"):
        svc.register(
            "r2", geometry=dev.geometry, device_pages=2, device_memory=dev.handle, model_id=MODEL, tp_rank=2, tp_size=2
        )
    svc.close()
    dev.close()
