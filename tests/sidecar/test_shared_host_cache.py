"""One host cache per node and model (hicache.sidecar.shared_cache): the pools of one namespace,
model, group, geometry and rank slice share host pages, the host budget and KV events; each
keeps its own pins, grants, lease and secret, and the cache closes with its last member."""

from __future__ import annotations

import uuid

import pytest
import torch
from sidecar_util import MODEL, filled_device, keys_for, make_service, mimo_geometries, shm_exists, zero_pages

from hicache.api import EventKind, KeyStatus, PoolInfo, Tier
from hicache.cache.config import HiCacheConfig
from hicache.pools import DeviceKVPool
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.service import HiCacheService

S = KeyStatus


def join(svc: HiCacheService, dev: DeviceKVPool, *, model: str = MODEL, namespace: str = "") -> PoolInfo:
    info = svc.register(
        uuid.uuid4().hex,
        geometry=dev.geometry,
        device_pages=dev.num_pages,
        device_memory=dev.handle,
        model_id=model,
        namespace=namespace,
    )
    assert isinstance(info, PoolInfo), info
    return info


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def devices() -> list[DeviceKVPool]:
    devs = [filled_device(8, seed=s) for s in (1, 2, 3)]
    yield devs
    for d in devs:
        d.close()


def test_a_second_engine_of_the_model_reloads_the_first_ones_pages_bit_exact(devices: list[DeviceKVPool]) -> None:
    svc = make_service()
    a, b, _ = devices
    try:
        ia, ib = join(svc, a), join(svc, b)
        assert ia.pool_id != ib.pool_id and ia.pool_secret != ib.pool_secret
        assert ia.host_shm_name == ib.host_shm_name  # one host pool
        ks = keys_for(4, seed=7)
        assert svc.offload("o", ia.pool_id, ks, [0, 1, 2, 3]).statuses == (S.STORED,) * 4
        assert svc.lookup(ib.pool_id, ks).tiers == (Tier.HOST,) * 4
        assert svc.offload("o", ib.pool_id, ks, [4, 5, 6, 7]).statuses == (S.DEDUPLICATED,) * 4  # no second copy
        zero_pages(b, range(8))
        assert svc.reload("r", ib.pool_id, ks, [7, 6, 5, 4]).statuses == (S.LOADED,) * 4
        for i in range(4):
            assert torch.equal(b.read_page(7 - i), a.read_page(i))
        sa, sb = svc.stats(ia.pool_id)[0], svc.stats(ib.pool_id)[0]
        assert sa.cache_id == sb.cache_id and sa.cache_members == sb.cache_members == 2
        assert sa.used_pages == sb.used_pages == 4  # the cache's pages, held once
        assert (sa.offload_bytes, sb.offload_bytes) == (4 * a.geometry.page_bytes, 0)  # copies are per member
        assert sb.reload_bytes == 4 * a.geometry.page_bytes and sa.reload_bytes == 0
        svc.check_integrity()
    finally:
        svc.close()


def test_a_registration_that_joins_a_live_cache_still_sweeps_dead_processes_segments(
    devices: list[DeviceKVPool],
) -> None:
    """The sweep belongs to every registration: engines killed while their cache lives on
    (other members hold it) leave device segments only a joining registration can remove."""
    import os

    from hicache.memory import shm

    svc = make_service()
    a, b, _ = devices
    ns, pid, start = shm._owner()
    dead = f"hicache-{ns}-{pid}-{start + 1}-{uuid.uuid4().hex[:24]}"  # this pid, another start: dead
    try:
        ia = join(svc, a)
        open(os.path.join(shm.shm_dir(), dead), "wb").close()
        ib = join(svc, b)
        assert ib.host_shm_name == ia.host_shm_name  # it joined; it built nothing
        assert not shm_exists(dead)
    finally:
        if shm_exists(dead):
            os.unlink(os.path.join(shm.shm_dir(), dead))
        svc.close()


def test_another_namespace_another_model_or_no_model_never_joins(devices: list[DeviceKVPool]) -> None:
    svc = make_service()
    a, b, c = devices
    try:
        ia = join(svc, a, namespace="tenant-a")
        ib = join(svc, b, namespace="tenant-b")
        ic = join(svc, c, model="other-model@rev1", namespace="tenant-a")
        ids = {svc.stats(i.pool_id)[0].cache_id for i in (ia, ib, ic)}
        assert len(ids) == 3
        ks = keys_for(2, seed=4)
        svc.offload("o", ia.pool_id, ks, [0, 1])
        assert svc.lookup(ib.pool_id, ks).tiers == (Tier.NONE,) * 2
        assert svc.lookup(ic.pool_id, ks).tiers == (Tier.NONE,) * 2
    finally:
        svc.close()
    svc = make_service()  # host memory only: a pool may leave its model unnamed
    try:
        ia, ib = join(svc, a, model=""), join(svc, b, model="")
        assert svc.stats(ia.pool_id)[0].cache_id != svc.stats(ib.pool_id)[0].cache_id
    finally:
        svc.close()


def test_the_host_budget_counts_a_shared_cache_once(devices: list[DeviceKVPool]) -> None:
    a, b, c = devices
    page = a.geometry.page_bytes
    svc = make_service(hierarchy=HiCacheConfig(storage_backend="none", size_gb=24 * page / 1e9))
    try:
        ia = join(svc, a)
        assert ia.host_pages == 24  # alone: the whole budget
        ib = join(svc, b)
        assert ib.host_pages == 24 and svc.stats(ia.pool_id)[0].host_pages == 24  # joined: nothing split
        ic = join(svc, c, model="other-model@rev1")
        assert svc.host_growth.settle(timeout=60)
        shared, other = svc.stats(ia.pool_id)[0].host_pages, svc.stats(ic.pool_id)[0].host_pages
        assert shared == svc.stats(ib.pool_id)[0].host_pages
        assert shared + other <= 24 and shared == other == 12  # two caches, not three pools
        svc.check_integrity()
    finally:
        svc.close()


def test_a_member_whose_lease_ends_releases_only_its_own_pins(devices: list[DeviceKVPool]) -> None:
    clock = Clock()
    svc = HiCacheService(ServiceConfig(expected=mimo_geometries(), lease_timeout_s=10.0), clock=clock)
    a, b, _ = devices
    try:
        ia, ib = join(svc, a), join(svc, b)
        ks = keys_for(4, seed=9)
        svc.offload("o", ia.pool_id, ks, [0, 1, 2, 3])
        want = [a.read_page(i).clone() for i in range(4)]
        assert svc.pin("p", ia.pool_id, ks[:2]) == (S.PINNED,) * 2
        assert svc.pin("p", ib.pool_id, ks[3:]) == (S.PINNED,)
        clock.now = 8.0
        svc.keep_alive(ib.pool_id)  # b keeps calling; a went silent (crashed)
        clock.now = 12.0
        assert svc.reap_expired() == [ia.pool_id]
        assert svc.stats(ib.pool_id)[0].cache_members == 1
        zero_pages(b, range(8))  # the pages outlive the engine that offloaded them
        assert svc.reload("r", ib.pool_id, ks, [4, 5, 6, 7]).statuses == (S.LOADED,) * 4
        assert all(torch.equal(b.read_page(4 + i), want[i]) for i in range(4))
        # a's pins went with it; b's stays
        assert svc.evict("e", ib.pool_id, ks).statuses == (S.EVICTED,) * 3 + (S.BUSY,)
        svc.check_integrity()
    finally:
        svc.close()


def test_eviction_by_one_member_keeps_the_pages_another_pinned(devices: list[DeviceKVPool]) -> None:
    svc = make_service()
    a, b, _ = devices
    try:
        ia, ib = join(svc, a), join(svc, b)
        ks = keys_for(4, seed=11)
        svc.offload("o", ia.pool_id, ks, [0, 1, 2, 3])
        assert svc.pin("p", ib.pool_id, ks[:2]) == (S.PINNED,) * 2
        assert svc.unpin("u", ia.pool_id, ks[:2]) == (S.NOT_PINNED,) * 2  # not a's to drop
        assert svc.evict("e", ia.pool_id, ks).statuses == (S.BUSY,) * 2 + (S.EVICTED,) * 2
        assert svc.evict("e2", ia.pool_id, num_pages=8).pages_freed == 0  # the rest is pinned
        assert svc.lookup(ia.pool_id, ks).tiers == (Tier.HOST,) * 2 + (Tier.NONE,) * 2
        zero_pages(b, range(8))
        assert svc.reload("r", ib.pool_id, ks[:2], [0, 1]).statuses == (S.LOADED,) * 2
        assert all(torch.equal(b.read_page(i), a.read_page(i)) for i in range(2))
        assert svc.unpin("u", ib.pool_id, ks[:3]) == (S.UNPINNED,) * 2 + (S.NOT_FOUND,)
        assert svc.unpin("u2", ib.pool_id, ks[:1]) == (S.NOT_PINNED,)
        svc.check_integrity()
    finally:
        svc.close()


def test_the_cache_closes_with_its_last_member(devices: list[DeviceKVPool]) -> None:
    svc = make_service()
    a, b, c = devices
    try:
        ia, ib = join(svc, a), join(svc, b)
        ks = keys_for(2, seed=13)
        svc.offload("o", ia.pool_id, ks, [0, 1])
        svc.unregister("u", ia.pool_id)  # an engine restarts while another holds the cache
        assert shm_exists(ia.host_shm_name)
        ia2 = join(svc, a)
        assert ia2.host_shm_name == ia.host_shm_name
        assert svc.lookup(ia2.pool_id, ks).tiers == (Tier.HOST,) * 2
        svc.unregister("u", ib.pool_id)
        svc.unregister("u2", ia2.pool_id)
        assert not shm_exists(ia.host_shm_name)  # gone with its last member
        ic = join(svc, c)
        assert ic.host_shm_name != ia.host_shm_name
        assert svc.lookup(ic.pool_id, ks).tiers == (Tier.NONE,) * 2
        svc.check_integrity()
    finally:
        svc.close()


def test_one_members_secret_never_works_for_another(devices: list[DeviceKVPool]) -> None:
    svc = make_service()
    a, b, _ = devices
    try:
        ia, ib = join(svc, a), join(svc, b)
        assert svc.owns(ia.pool_id, ia.pool_secret) and svc.owns(ib.pool_id, ib.pool_secret)
        assert not svc.owns(ia.pool_id, ib.pool_secret) and not svc.owns(ib.pool_id, ia.pool_secret)
    finally:
        svc.close()


def test_kv_events_fan_out_to_every_member(devices: list[DeviceKVPool]) -> None:
    svc = make_service()
    a, b, _ = devices
    try:
        ia = join(svc, a)
        sub = svc.subscribe(snapshot=False)
        ib = join(svc, b)
        ks = keys_for(2, seed=15)
        svc.offload("o", ia.pool_id, ks, [0, 1])
        svc.unregister("u", ia.pool_id)
        svc.evict("e", ib.pool_id, ks)
        batch = sub.next_batch(timeout=5)
        assert batch is not None
        seen: dict[tuple[EventKind, str], set[bytes]] = {}
        for e in batch.events:
            seen.setdefault((e.kind, e.pool.pool_id), set()).update(e.keys)
        assert (EventKind.POOL_REGISTERED, ib.pool_id) in seen
        for pool_id in (ia.pool_id, ib.pool_id):  # stored through a, published for both
            assert seen[(EventKind.STORED, pool_id)] == set(ks)
        assert (EventKind.POOL_UNREGISTERED, ia.pool_id) in seen
        assert seen[(EventKind.REMOVED, ib.pool_id)] == set(ks)
        assert (EventKind.REMOVED, ia.pool_id) not in seen  # a was gone by then
    finally:
        svc.close()


def test_a_joining_registration_that_fails_leaves_the_cache_as_it_was(devices: list[DeviceKVPool]) -> None:
    svc = make_service()
    a, b, _ = devices
    try:
        ia = join(svc, a)
        ks = keys_for(2, seed=17)
        svc.offload("o", ia.pool_id, ks, [0, 1])
        with pytest.raises(ValueError, match="device_pages"):
            svc.register("bad", geometry=b.geometry, device_pages=0, device_memory=b.handle, model_id=MODEL)
        s = svc.stats(ia.pool_id)[0]
        assert s.cache_members == 1 and s.used_pages == 2
        assert len(svc.pool_ids) == 1
        svc.check_integrity()
    finally:
        svc.close()
