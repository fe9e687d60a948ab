"""HiCacheService without gRPC: transfers, statuses, validation, idempotency, leases."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sidecar_util import filled_device, keys_for, make_service, mimo_full, pages_of, shm_exists

from hicache.api import KeyStatus, PoolInfo, Tier
from hicache.cache.config import HiCacheConfig
from hicache.geometry import KVGeometry
from hicache.memory import MemoryHandle, RefCountedOpens
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.errors import NoSpace, StateError
from hicache.sidecar.service import HiCacheService

S = KeyStatus


def register(svc: HiCacheService, dev, rid: str = "reg-1", **kw) -> PoolInfo:
    info = svc.register(rid, geometry=dev.geometry, device_pages=dev.num_pages, device_memory=dev.handle, **kw)
    assert isinstance(info, PoolInfo)
    return info


@pytest.fixture
def setup():
    svc = make_service()
    dev = filled_device(8)
    info = register(svc, dev)
    yield svc, dev, info
    svc.close()
    dev.close()


def test_offload_dedup_reload_bit_exact(setup):
    svc, dev, info = setup
    keys = keys_for(4)
    src = pages_of(dev, [0, 1, 2, 3])
    r = svc.offload("o1", info.pool_id, keys, [0, 1, 2, 3])
    assert r.statuses == (S.STORED,) * 4 and r.bytes_copied == 4 * dev.geometry.page_bytes
    r = svc.offload("o2", info.pool_id, keys, [0, 1, 2, 3])
    assert r.statuses == (S.DEDUPLICATED,) * 4 and r.bytes_copied == 0
    untouched = pages_of(dev, [4])
    r = svc.reload("r1", info.pool_id, keys[1:], [5, 6, 7])
    assert r.statuses == (S.LOADED,) * 3 and r.done
    assert all(torch.equal(a, b) for a, b in zip(src[1:], pages_of(dev, [5, 6, 7]), strict=True))
    assert torch.equal(untouched[0], dev.read_page(4)) and torch.equal(src[0], dev.read_page(0))
    svc.check_integrity()


def test_reload_serves_the_prefix_and_leaves_other_pages_untouched(setup):
    """Chained keys: a page after a missing one is useless, so it is NOT_FOUND too."""
    svc, dev, info = setup
    keys = keys_for(3)
    svc.offload("o", info.pool_id, [keys[0], keys[2]], [0, 2])
    before = pages_of(dev, [6, 7])
    r = svc.reload("r", info.pool_id, keys, [5, 6, 7])
    assert r.statuses == (S.LOADED, S.NOT_FOUND, S.NOT_FOUND)
    assert all(torch.equal(a, b) for a, b in zip(before, pages_of(dev, [6, 7]), strict=True))
    assert torch.equal(dev.read_page(0), dev.read_page(5))
    host = svc.stats(info.pool_id)[0].tiers[0]
    assert (host.hits, host.misses) == (1, 2)
    svc.check_integrity()


def test_layerwise_reload_publishes_every_layer():
    svc = make_service(layerwise_inline_bytes=0)  # every layer-wise reload goes layer by layer
    dev = filled_device(8)
    info = register(svc, dev)
    keys = keys_for(2)
    svc.offload("o", info.pool_id, keys, [0, 1])
    r = svc.reload("r", info.pool_id, keys, [4, 5], layerwise=True)
    assert not r.done and r.op_id and r.progress_words > 0
    events = list(svc.watch(info.pool_id, r.op_id))
    layers = dev.geometry.layer_num
    assert [e.kind for e in events] == ["layer_done"] * layers + ["done"]
    assert [e.layer for e in events[:-1]] == list(range(layers))
    assert torch.equal(dev.read_page(0), dev.read_page(4)) and torch.equal(dev.read_page(1), dev.read_page(5))
    pool = svc.pool(info.pool_id)
    assert all(pool.index.refs(k) == 0 for k in keys)  # references released
    assert svc.evict("e", info.pool_id, keys).statuses == (S.EVICTED, S.EVICTED)
    with pytest.raises(KeyError, match="op-nope"):
        svc.watch(info.pool_id, "op-nope")
    svc.check_integrity()


def test_a_small_layerwise_reload_is_copied_before_the_answer(setup):
    svc, dev, info = setup
    keys = keys_for(2)
    svc.offload("o", info.pool_id, keys, [0, 1])
    nbytes = 2 * dev.geometry.page_bytes
    assert nbytes < ServiceConfig().layerwise_inline_bytes
    r = svc.reload("r", info.pool_id, keys, [4, 5], layerwise=True)
    assert r.done and r.bytes_copied == nbytes and r.progress_words == 0  # nothing left to wait for
    assert torch.equal(dev.read_page(0), dev.read_page(4)) and torch.equal(dev.read_page(1), dev.read_page(5))
    events = list(svc.watch(info.pool_id, r.op_id))  # Watch still tells the whole story
    assert [e.kind for e in events] == ["layer_done"] * dev.geometry.layer_num + ["done"]
    assert all(svc.pool(info.pool_id).index.refs(k) == 0 for k in keys)
    with pytest.raises(ValueError, match="layerwise_inline_bytes must be >= 0, got -1"):
        ServiceConfig(layerwise_inline_bytes=-1)


def test_no_space_is_per_key_and_resident_keys_survive():
    svc = make_service(hierarchy=HiCacheConfig(storage_backend="none", ratio=0.5))  # 8 device pages -> 4 host pages
    dev = filled_device(8)
    info = register(svc, dev)
    assert info.host_pages == 4
    keys = keys_for(8)
    r = svc.offload("a", info.pool_id, keys[:6], list(range(6)))
    assert r.statuses == (S.STORED,) * 4 + (S.NO_SPACE,) * 2
    # keys[0] is resident: the allocation for the new keys evicts others, never it
    r = svc.offload("b", info.pool_id, [keys[0], *keys[4:8]], [0, 4, 5, 6, 7])
    assert r.statuses == (S.DEDUPLICATED, S.STORED, S.STORED, S.STORED, S.NO_SPACE)
    assert svc.lookup(info.pool_id, [keys[0]]).prefix_length == 1
    assert svc.pin("p", info.pool_id, [keys[0], *keys[4:7]]) == (S.PINNED,) * 4
    assert svc.offload("c", info.pool_id, [keys[7]], [7]).statuses == (S.NO_SPACE,)
    svc.check_integrity()
    svc.close()
    dev.close()


def test_lookup_evict_pin_prefetch(setup):
    svc, dev, info = setup
    keys = keys_for(5)
    svc.offload("o", info.pool_id, keys[:3], [0, 1, 2])
    r = svc.lookup(info.pool_id, [keys[0], keys[1], keys[3], keys[2]])
    assert r.prefix_length == 2 and r.tiers == (Tier.HOST, Tier.HOST, Tier.NONE, Tier.HOST)
    assert svc.prefetch("f", info.pool_id, keys[2:4]).statuses == (S.RESIDENT, S.MISSING)
    assert svc.pin("p", info.pool_id, [keys[0], keys[4]]) == (S.PINNED, S.NOT_FOUND)
    assert svc.evict("e", info.pool_id, [keys[0], keys[1], keys[4]]).statuses == (S.BUSY, S.EVICTED, S.NOT_FOUND)
    assert svc.unpin("u", info.pool_id, [keys[0], keys[0], keys[2]]) == (S.UNPINNED, S.NOT_PINNED, S.NOT_PINNED)
    r = svc.evict("e2", info.pool_id, num_pages=5)
    assert r.pages_freed == 2 and r.statuses == ()
    assert svc.lookup(info.pool_id, keys).prefix_length == 0
    stats = svc.stats(info.pool_id)[0]
    assert stats.used_pages == 0 and stats.storage_backend == "none" and stats.storage_healthy
    svc.check_integrity()


def test_evict_lru_order(setup):
    svc, dev, info = setup
    keys = keys_for(4)
    svc.offload("o", info.pool_id, keys, [0, 1, 2, 3])  # a chain: its tail is evicted first
    assert svc.evict("e", info.pool_id, num_pages=1).pages_freed == 1
    assert svc.lookup(info.pool_id, keys).tiers == (Tier.HOST, Tier.HOST, Tier.HOST, Tier.NONE)
    svc.lookup(info.pool_id, [keys[2]])  # keys[2] becomes most recently used
    assert svc.evict("e2", info.pool_id, num_pages=1).pages_freed == 1
    assert svc.lookup(info.pool_id, keys).tiers == (Tier.HOST, Tier.NONE, Tier.HOST, Tier.NONE)


def _bad_calls(keys):
    k32 = keys[0]
    return [
        ("offload", (["o", keys[:2], [0, 99]],), "99"),
        ("offload", (["o", keys[:2], [3, 3]],), "duplicate page 3"),
        ("offload", (["o", [k32, k32], [0, 1]],), "keys[1] repeats keys[0]"),
        ("offload", (["o", [b"short"], [0]],), "keys[0] must be a 32-byte"),
        ("offload", (["o", keys[:2], [0]],), "2 keys but 1 device_pages"),
        ("offload", (["o", keys[:5], [0, 1, 2, 3, 4]],), "batch of 5 keys exceeds the limit of 4"),
        ("reload", (["r", keys[:2], [0, 8]],), "8"),
        ("evict", (["e", [], 0],), "either keys or num_pages"),
        ("evict", (["e", keys[:1], 3],), "either keys or num_pages"),
        ("pin", (["p", [b"x" * 16]],), "keys[0] must be a 32-byte"),
        ("offload", (["o", keys[:2], [0, 1], 1],), "ready_event must be 0 or 1..0"),  # no events registered
        # a proto's uint64 pages: named as sent, never as the negative int64 they would wrap to
        ("offload", (["o", keys[:1], [2**64 - 1]],), f"page {2**64 - 1} out of range"),
        ("reload", (["r", keys[:2], [0, 2**63]],), f"page {2**63} out of range"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_input_names_value_and_changes_nothing(case):
    svc = make_service(max_batch=4)
    dev = filled_device(8)
    info = register(svc, dev)
    keys = keys_for(6)
    svc.offload("seed", info.pool_id, keys[2:4], [2, 3])
    method, (args,), needle = _bad_calls(keys)[case]
    before_dev = dev.flat.clone()
    before = svc.stats(info.pool_id)[0]
    resident = set(svc.pool(info.pool_id).index.keys())
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        getattr(svc, method)(args[0], info.pool_id, *args[1:])
    svc.check_integrity()
    after = svc.stats(info.pool_id)[0]
    assert dataclasses.replace(after, tiers=before.tiers) == before and after.tiers == before.tiers
    assert set(svc.pool(info.pool_id).index.keys()) == resident
    assert torch.equal(before_dev, dev.flat)
    svc.close()


def test_unknown_pool_is_key_error(setup):
    svc, _, _ = setup
    for call in (
        lambda: svc.offload("o", "pool-nope", [], []),
        lambda: svc.lookup("pool-nope", []),
        lambda: svc.unregister("u", "pool-nope"),
        lambda: svc.stats("pool-nope"),
    ):
        with pytest.raises(KeyError, match="pool-nope"):
            call()


def test_geometry_mismatch_names_each_field():
    svc = make_service()
    g = mimo_full()
    wrong = KVGeometry(**{**g.to_dict(), "v_head_dim": 192, "head_num": 8})
    dev = filled_device(4, geometry=wrong)
    with pytest.raises(ValueError, match="v_head_dim") as exc:
        svc.register("r", geometry=wrong, device_pages=4, device_memory=dev.handle)
    assert "head_num" in str(exc.value) and "192" in str(exc.value) and "128" in str(exc.value)
    with pytest.raises(ValueError, match="'mla'"):
        svc.register("r2", geometry=g, device_pages=4, device_memory=dev.handle, group="mla")
    assert svc.pool_ids == []
    svc.close()
    dev.close()


def test_a_pipeline_stage_registers_its_own_layers_of_the_model():
    """With pipeline parallelism each stage's pool holds some of a group's layers; the sidecar's
    model config checks it against those layers, and still refuses a layer the group lacks."""
    svc = make_service()
    g = mimo_full()
    assert g.layer_ids is not None and len(g.layer_ids) > 2
    stage_ids = g.layer_ids[len(g.layer_ids) // 2 :]
    stage = dataclasses.replace(g, layer_num=len(stage_ids), layer_ids=stage_ids)
    dev = filled_device(4, geometry=stage)
    try:
        info = register(svc, dev)
        assert info.geometry_fingerprint == stage.fingerprint != g.fingerprint
        stray = dataclasses.replace(stage, layer_ids=(*stage_ids[:-1], max(g.layer_ids) + 1))
        with pytest.raises(ValueError, match="layer_ids"):
            svc.register("r2", geometry=stray, device_pages=4, device_memory=dev.handle)
        wider = dataclasses.replace(stage, head_dim=g.head_dim * 2)  # a stage is still checked field by field
        with pytest.raises(ValueError, match="head_dim"):
            svc.register("r3", geometry=wider, device_pages=4, device_memory=dev.handle)
        assert svc.pool_ids == [info.pool_id]
    finally:
        svc.close()
        dev.close()


def test_register_validates_memory_and_hash():
    svc = make_service()
    dev = filled_device(4)
    g = dev.geometry
    with pytest.raises(ValueError, match="1474560 bytes but 8 pages"):
        svc.register("a", geometry=g, device_pages=8, device_memory=dev.handle)
    ghost = MemoryHandle("shm", dev.nbytes, name="hicache-doesnotexist")
    with pytest.raises(ValueError, match="hicache-doesnotexist.* is refused"):
        svc.register("b", geometry=g, device_pages=4, device_memory=ghost)
    with pytest.raises(ValueError, match="'md5'"):
        svc.register("c", geometry=g, device_pages=4, device_memory=dev.handle, key_hash="md5")
    with pytest.raises(ValueError, match="'local'"):
        svc.register("d", geometry=g, device_pages=4, device_memory=MemoryHandle("local", dev.nbytes))
    with pytest.raises(ValueError, match="offload_event_handles are CUDA events, for CUDA pools.*'shm'"):
        svc.register("e", geometry=g, device_pages=4, device_memory=dev.handle, offload_events=[bytes(64)])
    cuda = MemoryHandle("cuda_ipc", dev.nbytes, ipc_handle=bytes(64))  # checked before anything is mapped
    with pytest.raises(ValueError, match=r"offload_event_handles\[1\] must be a 64-byte CUDA IPC event handle, got 63"):
        svc.register("f", geometry=g, device_pages=4, device_memory=cuda, offload_events=[bytes(64), bytes(63)])
    with pytest.raises(ValueError, match="offload_event_handles: at most 256 event handles, got 257"):
        svc.register("g", geometry=g, device_pages=4, device_memory=cuda, offload_events=[bytes(64)] * 257)
    assert svc.pool_ids == []
    svc.close()
    dev.close()


@pytest.mark.parametrize("pages", [9, 10**9])
def test_an_engine_layout_of_more_pages_than_its_memory_holds_is_invalid(pages: int) -> None:
    svc = make_service()
    dev = filled_device(8)
    try:
        with pytest.raises(ValueError, match=rf"the memory holds {dev.nbytes} \(device_pages={pages}\)"):
            svc.register(
                "r",
                geometry=dev.geometry,
                device_pages=pages,
                device_memory=dev.handle,
                device_layout="sglang_layer_first",
            )
        assert svc.pool_ids == []
    finally:
        svc.close()
        dev.close()


def test_transfers_on_a_closing_pool_are_state_errors(setup):
    svc, _, info = setup
    svc.pool(info.pool_id).close()  # unregister's window: closed, still listed until removed
    for call in (
        lambda: svc.offload("o", info.pool_id, keys_for(1), [0]),
        lambda: svc.reload("r", info.pool_id, keys_for(1), [0]),
    ):
        with pytest.raises(StateError, match="is closed"):  # not a stat of the engine's closed fd
            call()


def test_no_space_for_another_pool_and_host_size_from_gb():
    dev = filled_device(4)
    g = dev.geometry
    svc = make_service(max_pools=1, hierarchy=HiCacheConfig(storage_backend="none", size_gb=g.page_bytes * 3 / 1e9))
    info = register(svc, dev)
    assert info.host_pages == 3
    out = svc.register("again", geometry=g, device_pages=4, device_memory=dev.handle)
    assert isinstance(out, NoSpace) and "limit is 1" in out.reason
    svc.close()
    with pytest.raises(StateError):
        svc.register("late", geometry=g, device_pages=4, device_memory=dev.handle)
    dev.close()


def test_idempotent_retry(setup):
    svc, dev, info = setup
    keys = keys_for(2)
    first = svc.offload("same", info.pool_id, keys, [0, 1])
    again = svc.offload("same", info.pool_id, keys, [0, 1])
    assert again == first and again.statuses == (S.STORED, S.STORED)
    assert svc.stats(info.pool_id)[0].offload_bytes == first.bytes_copied
    with pytest.raises(ValueError, match="'same' was already used"):
        svc.offload("same", info.pool_id, keys, [2, 3])
    assert svc.pin("p", info.pool_id, keys[:1]) == svc.pin("p", info.pool_id, keys[:1])
    assert svc.pool(info.pool_id).index.pins(keys[0]) == 1
    assert register(svc, dev, rid="reg-1").pool_id == info.pool_id  # the fixture's registration
    assert len(svc.pool_ids) == 1
    svc.unregister("u", info.pool_id)
    svc.unregister("u", info.pool_id)  # a retried unregister succeeds too


def test_request_id_must_be_given(setup):
    svc, _, info = setup
    with pytest.raises(ValueError, match="request_id"):
        svc.offload("", info.pool_id, [], [])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lease_expiry_reclaims_pool_and_unlinks_shm():
    clock = FakeClock()
    svc = HiCacheService(ServiceConfig(lease_timeout_s=10), clock=clock)
    dev, dev2 = filled_device(4), filled_device(4, seed=1)
    quiet, busy = register(svc, dev, "a"), register(svc, dev2, "b")
    assert shm_exists(quiet.host_shm_name)
    clock.now = 8
    svc.keep_alive(busy.pool_id)
    clock.now = 12
    assert svc.reap_expired() == [quiet.pool_id]
    assert not shm_exists(quiet.host_shm_name) and shm_exists(busy.host_shm_name)
    assert shm_exists(dev.handle.name)  # the engine's memory is the engine's
    with pytest.raises(KeyError):
        svc.lookup(quiet.pool_id, [])
    svc.check_integrity()
    svc.close()
    assert not shm_exists(busy.host_shm_name)
    dev.close()
    dev2.close()


def test_a_lease_renewed_after_the_reaper_listed_it_keeps_its_pool():
    """The reaper lists the expired leases, then releases them one by one: a KeepAlive that
    lands in between renews the lease, and the pool must stay."""
    clock = FakeClock()
    svc = HiCacheService(ServiceConfig(lease_timeout_s=10), clock=clock)
    dev = filled_device(4)
    info = register(svc, dev, "a")
    listed = svc._pools.expired

    def listed_then_renewed() -> list[str]:
        ids = listed()
        svc.keep_alive(info.pool_id)  # the engine's KeepAlive, just after the list was made
        return ids

    try:
        clock.now = 11
        svc._pools.expired = listed_then_renewed  # type: ignore[method-assign]
        assert svc.reap_expired() == []
        assert svc.pool_ids == [info.pool_id] and shm_exists(info.host_shm_name)
        svc._pools.expired = listed  # type: ignore[method-assign]
        clock.now = 22
        assert svc.reap_expired() == [info.pool_id]  # not renewed again: it goes
        assert svc.reap_expired() == []
    finally:
        svc.close()
        dev.close()


def test_a_failing_step_of_a_pool_close_leaves_no_memory_behind(setup, monkeypatch):
    """The storage tier's close raises: the host memory is unlinked all the same, the pool is
    gone, and the error surfaces."""
    svc, dev, info = setup
    pool = svc._pools.peek(info.pool_id)

    def broken() -> None:
        raise OSError("tier close failed")

    monkeypatch.setattr(pool.cache.storage, "close", broken)
    with pytest.raises(OSError, match="tier close failed"):
        svc.unregister("u", info.pool_id)
    assert not shm_exists(info.host_shm_name)  # the steps after the failed one ran
    assert pool.closed and svc.pool_ids == []
    # the sidecar's own close goes on past a pool whose close fails, to the next pool
    dev2 = filled_device(4, seed=1)
    a, b = register(svc, dev2, "a"), register(svc, dev2, "b")
    for pool_id in (a.pool_id, b.pool_id):
        monkeypatch.setattr(svc._pools.peek(pool_id).cache.storage, "close", broken)
    svc.close()
    assert svc.pool_ids == [] and not shm_exists(a.host_shm_name) and not shm_exists(b.host_shm_name)
    dev2.close()


def test_refcounted_opens_share_and_close_once():
    opened, closed = [], []
    table: RefCountedOpens[str, int] = RefCountedOpens(lambda k: opened.append(k) or len(opened), closed.append)
    assert table.acquire("h") == 1 and table.acquire("h") == 1 and table.users("h") == 2
    table.release("h")
    assert closed == []
    table.release("h")
    assert opened == ["h"] and closed == [1] and len(table) == 0
    with pytest.raises(KeyError, match="'h'"):
        table.release("h")


def test_reload_with_repeated_keys_is_refused_without_a_stuck_operation(setup):
    svc, dev, info = setup
    keys = keys_for(2)
    svc.offload("o", info.pool_id, keys, [0, 1])
    with pytest.raises(ValueError, match=r"keys\[1\] repeats keys\[0\]"):
        svc.reload("r", info.pool_id, [keys[0], keys[0]], [2, 3])
    assert svc.stats(info.pool_id)[0].ops_in_flight == 0
    svc.check_integrity()


def test_close_waits_for_a_call_in_flight(setup):
    import threading

    svc, dev, info = setup
    pool = svc.pool(info.pool_id)
    entered, release = threading.Event(), threading.Event()
    real_offload = pool.engine.offload

    def slow_offload(*args, **kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(30)
        return real_offload(*args, **kwargs)

    pool.engine.offload = slow_offload  # type: ignore[method-assign]
    result: list[object] = []
    call = threading.Thread(target=lambda: result.append(svc.offload("o", info.pool_id, keys_for(1), [0])))
    call.start()
    assert entered.wait(30)
    closer = threading.Thread(target=lambda: svc.unregister("u", info.pool_id))
    closer.start()
    closer.join(0.5)
    assert closer.is_alive() and shm_exists(info.host_shm_name)  # waits: the copy still uses host memory
    release.set()
    call.join(30)
    closer.join(30)
    assert not closer.is_alive() and result and result[0].statuses == (S.STORED,)  # type: ignore[attr-defined]
    assert not shm_exists(info.host_shm_name)
    with pytest.raises(KeyError):
        svc.pool(info.pool_id)


def test_concurrent_registrations_respect_the_pool_limit():
    import threading

    svc = make_service(max_pools=1)
    devs = [filled_device(2, seed=i) for i in range(2)]
    barrier = threading.Barrier(2)
    answers: list[object] = []

    def reg(dev) -> None:  # type: ignore[no-untyped-def]
        barrier.wait()
        answers.append(svc.register(f"r{id(dev)}", geometry=dev.geometry, device_pages=2, device_memory=dev.handle))

    threads = [threading.Thread(target=reg, args=(d,)) for d in devs]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert sorted(type(a).__name__ for a in answers) == ["NoSpace", "PoolInfo"]
    assert len(svc.pool_ids) == 1
    svc.check_integrity()
    svc.close()
    for d in devs:
        d.close()


def test_a_host_pool_cannot_be_registered_as_device_memory(setup):
    svc, dev, info = setup
    host = MemoryHandle("shm", dev.nbytes * 2, name=info.host_shm_name)  # 2x ratio: same geometry, 16 pages
    with pytest.raises(ValueError, match="is refused: the sidecar maps only memory the engine shows it owns"):
        svc.register("r2", geometry=dev.geometry, device_pages=16, device_memory=host)
    assert svc.pool_ids == [info.pool_id]
    svc.check_integrity()


def test_the_operation_table_stays_bounded_and_keeps_the_unfinished_and_the_newest_finished():
    from hicache.sidecar.errors import UnknownId
    from hicache.sidecar.operations import Operation, OperationTable

    table = OperationTable(keep_finished=8)
    running = Operation("op-running", 2)
    table.add(running)
    for i in range(1000):
        op = Operation(f"op-{i}", 2)
        op.done()
        table.add(op)
        assert len(table._ops) <= 2 * 8 + 1  # the running one, and at most twice the kept finished
    assert table.get("op-running") is running and table.in_flight() == [running]
    for i in range(992, 1000):  # the newest eight finished are always there
        assert table.get(f"op-{i}").finished
    with pytest.raises(UnknownId, match="op-0"):
        table.get("op-0")
