"""--hicache-size is one host budget for the whole sidecar: split among its pools by the
documented rule, rebalanced at every registration and release, with the memory of a shrunk
pool given back, and what stays on host still bit-exact."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sidecar_util import MODEL, filled_device, keys_for, mimo_full, pages_of

from hicache.api import KeyStatus, PoolInfo, Tier
from hicache.cache.config import HiCacheConfig
from hicache.cache.index import HostIndex
from hicache.memory import MemoryHandle, shm_dir
from hicache.pools import DeviceKVPool
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.errors import NoSpace
from hicache.sidecar.host_budget import Claim, split
from hicache.sidecar.service import HiCacheService

PAGE = mimo_full().page_bytes
ENGINE = MemoryHandle("engine", 0)  # an engine-copy pool: its device size is a claim


@given(
    budget=st.integers(1, 10**12),
    claims=st.lists(
        st.tuples(st.integers(1, 10**15), st.integers(1, 10**8), st.sampled_from("abc")), min_size=1, max_size=16
    ),
)
@settings(max_examples=300, deadline=None)
def test_the_shares_never_exceed_the_budget_and_keep_a_floor_whatever_the_weights(
    budget: int, claims: list[tuple[int, int, str]]
) -> None:
    cs = [Claim(w, p, namespace=ns) for w, p, ns in claims]
    pages = split(budget, cs)
    assert sum(n * c.page_bytes for n, c in zip(pages, cs, strict=True)) <= budget
    tenants = {c.namespace for c in cs}
    for c, got in zip(cs, pages, strict=True):  # at least its floor (whole pages of it), any weights
        part = budget // (2 * len(tenants))  # its namespace's floor
        mates = sum(d.namespace == c.namespace for d in cs)
        assert got >= part // (2 * mates) // c.page_bytes


def test_the_split_rule_worked_through() -> None:
    # budget 100, two pools of one namespace: floors 100 // 4 = 25 each; the other 50 split 3:1
    big, small = Claim(30, 1), Claim(10, 1)
    assert split(100, [big, small]) == [25 + 50 * 3 // 4, 25 + 50 // 4]
    assert split(100, [Claim(30, 1, max_pages=40), small]) == [40, 37]  # never past its segment
    assert split(10, [Claim(10, 20)]) == [0]  # a share of less than a page
    # namespaces first: a gets 25 + 50 * 40 // 50 = 65 and b 25 + 10 = 35; then a's two pools
    # split a's 65: floors 16 each, the other 33 split 3:1
    assert split(100, [big, Claim(10, 1, namespace="b"), small]) == [16 + 33 * 3 // 4, 35, 16 + 33 // 4]
    with pytest.raises(ValueError, match="budget must be >= 1 byte"):
        split(0, [big])


def test_a_huge_unchecked_claim_moves_only_its_own_namespaces_part() -> None:
    """#46 point 4: an engine-copy pool claimed 10**6 device pages, which the sidecar cannot
    check, and another tenant's host share fell from 1,356 pages to 64."""
    budget_pages = 64
    svc = budget_service(budget_pages * PAGE / 1e9)
    victim_dev = filled_device(8, seed=1)
    try:
        victim = svc.register(
            "v", geometry=victim_dev.geometry, device_pages=8, device_memory=victim_dev.handle, namespace="b"
        )
        assert isinstance(victim, PoolInfo) and victim.host_pages == budget_pages
        claims = [
            svc.register(f"x{i}", geometry=mimo_full(), device_pages=10**6, device_memory=ENGINE, namespace="a")
            for i in range(3)
        ]
        assert all(isinstance(c, PoolInfo) for c in claims)
        assert svc.stats(victim.pool_id)[0].host_pages >= budget_pages // 4  # the other namespace's floor
        total = sum(svc.stats(p.pool_id)[0].host_pages for p in [victim, *claims] if isinstance(p, PoolInfo))
        assert total <= budget_pages
        svc.check_integrity()
    finally:
        svc.close()
        victim_dev.close()


def test_the_index_shrinks_evicts_above_the_line_and_grows_back() -> None:
    index = HostIndex(8)
    got = index.allocate(6)
    assert got is not None
    pages, _ = got
    for i, p in enumerate(pages):
        index.bind(bytes([i + 1]), p)
    index.pin(bytes([6]))  # page 5: pinned above the line to come
    evicted = index.resize(3)
    assert sorted(p for _, p in evicted) == [3, 4]
    assert index.limit == 3 and index.free_pages == 0 and bytes([6]) in index
    index.check_integrity()
    assert sorted(index.take_retired()) == [3, 4, 6, 7]
    index.unpin(bytes([6]))  # released above the line: dropped, its page retired
    assert bytes([6]) not in index and index.take_retired() == [5]
    got = index.allocate(2)  # only evicting below the line gives room
    assert got is not None and all(p < 3 for p in got[0]) and len(got[1]) == 2
    index.release(got[0])
    assert index.resize(8) == [] and index.free_pages == 7 and len(index) == 1
    index.check_integrity()
    with pytest.raises(ValueError, match=r"limit must be an int in \[1, 8\], got 9"):
        index.resize(9)


def test_a_page_reserved_before_a_shrink_and_bound_after_it_is_never_reused() -> None:
    index = HostIndex(4)
    got = index.allocate(4)
    assert got is not None
    index.resize(2)  # pages 2 and 3 are reserved (an offload in flight)
    index.bind(b"late", 3)
    index.check_integrity()
    assert index.evictable_pages == 0 and index.evict(4) == []  # above the line: not evictable, not reused
    index.release([0, 1, 2])
    assert sorted(index.allocate(2)[0]) == [0, 1]  # type: ignore[index]
    index.resize(4)  # grown back: the late key is evictable again
    assert index.evictable_pages == 1
    index.check_integrity()


def budget_service(gb: float) -> HiCacheService:
    return HiCacheService(ServiceConfig(hierarchy=HiCacheConfig(storage_backend="none", size_gb=gb)))


def register(svc: HiCacheService, dev: DeviceKVPool, rid: str) -> PoolInfo:
    """A pool of a model of its own (pools of one model would share one host cache)."""
    info = svc.register(
        rid, geometry=dev.geometry, device_pages=dev.num_pages, device_memory=dev.handle, model_id=f"{MODEL}-{rid}"
    )
    assert isinstance(info, PoolInfo), info
    return info


def allocated_bytes(shm_name: str) -> int:
    return os.stat(os.path.join(shm_dir(), shm_name)).st_blocks * 512


def test_pools_share_the_sidecars_budget_and_a_shrunk_pool_gives_its_memory_back() -> None:
    budget_pages = 24
    svc = budget_service(budget_pages * PAGE / 1e9)
    first_dev, second_dev = filled_device(8, seed=1), filled_device(8, seed=2)
    try:
        first = register(svc, first_dev, "a")
        assert first.host_pages == budget_pages  # alone, it has the whole budget
        keys = keys_for(8, seed=3)
        assert svc.offload("o1", first.pool_id, keys, list(range(8))).statuses == (KeyStatus.STORED,) * 8
        before = allocated_bytes(first.host_shm_name)
        second = register(svc, second_dev, "b")
        a, b = (svc.stats(p)[0].host_pages for p in (first.pool_id, second.pool_id))
        assert a + b <= budget_pages and a == b == split(budget_pages * PAGE, [Claim(8 * PAGE, PAGE)] * 2)[0]
        assert allocated_bytes(first.host_shm_name) < before  # the pages above the line were given back
        assert allocated_bytes(first.host_shm_name) <= a * PAGE + 64 * 4096
        # what stayed below the line reloads bit-exact; what was above is gone from host
        tiers = svc.lookup(first.pool_id, keys).tiers
        kept = [k for k, t in zip(keys, tiers, strict=True) if t is Tier.HOST]
        assert 0 < len(kept) <= a
        want = {k: page for k, page in zip(keys, pages_of(first_dev, list(range(8))), strict=True)}
        r = svc.reload("r1", first.pool_id, kept, list(range(len(kept))))  # over the engine's pages 0..
        assert r.statuses == (KeyStatus.LOADED,) * len(kept)
        for k, got in zip(kept, pages_of(first_dev, list(range(len(kept)))), strict=True):
            assert torch.equal(got, want[k])
        svc.unregister("u", second.pool_id)
        assert svc.host_growth.settle(timeout=60)  # it grows back in the background
        assert svc.stats(first.pool_id)[0].host_pages == budget_pages  # to its segment
        assert svc.offload("o2", first.pool_id, keys, list(range(8))).statuses.count(KeyStatus.NO_SPACE) == 0
        svc.check_integrity()
    finally:
        svc.close()
        first_dev.close()
        second_dev.close()


def test_a_budget_too_small_for_another_pool_is_refused_naming_it() -> None:
    svc = budget_service(1.5 * PAGE / 1e9)
    devs = [filled_device(8, seed=i) for i in range(2)]
    try:
        first = register(svc, devs[0], "a")
        assert first.host_pages == 1
        refused = svc.register(
            "b", geometry=devs[1].geometry, device_pages=8, device_memory=devs[1].handle, model_id=MODEL
        )
        assert (
            isinstance(refused, NoSpace)
            and "--hicache-size" in refused.reason
            and "less than one page" in refused.reason
        )
        assert svc.stats(first.pool_id)[0].host_pages == 1 and len(svc.pool_ids) == 1  # nothing changed
    finally:
        svc.close()
        for d in devs:
            d.close()


BAD_REGISTRATIONS = {
    "unproven shm": (8, "", "hicache-no-such-segment", "is refused"),
    "pages past the memory": (10**9, "sglang_layer_first", "", r"\(device_pages=1000000000\)"),
}


@pytest.mark.parametrize("bad", sorted(BAD_REGISTRATIONS))
def test_a_registration_that_fails_validation_evicts_nothing_from_the_live_pools(bad: str) -> None:
    pages, layout, shm_name, error = BAD_REGISTRATIONS[bad]
    svc = budget_service(16 * PAGE / 1e9)
    dev = filled_device(8, seed=1)
    try:
        first = register(svc, dev, "a")
        keys = keys_for(16, seed=3)
        for i in range(2):  # its whole share filled
            stored = svc.offload(f"o{i}", first.pool_id, keys[8 * i : 8 * (i + 1)], list(range(8))).statuses
            assert stored == (KeyStatus.STORED,) * 8
        memory = MemoryHandle("shm", dev.nbytes, name=shm_name or dev.handle.name, proof=dev.handle.proof)
        with pytest.raises(ValueError, match=error):
            svc.register(
                "b",
                geometry=dev.geometry,
                device_pages=pages,
                device_memory=memory,
                model_id=MODEL,
                device_layout=layout,
            )
        assert svc.stats(first.pool_id)[0].host_pages == first.host_pages == 16
        assert svc.lookup(first.pool_id, keys).tiers == (Tier.HOST,) * 16  # no page was evicted for it
        assert svc.pool_ids == [first.pool_id]
        svc.check_integrity()
    finally:
        svc.close()
        dev.close()
