"""HierarchicalCache: eviction and pins, write policies, load from storage, real backends."""

import time
from collections.abc import Iterator

import pytest
from tier_helpers import GEOMETRIES, GEOMETRY_NAMES, MemoryTier, RedisServer, identity, key, payload

from hicache.cache.tiering import HierarchicalCache
from hicache.pools import HostKVPool
from hicache.storage import make_tier


@pytest.fixture
def build() -> Iterator:
    made: list[tuple[HierarchicalCache, HostKVPool]] = []

    def make(name: str, pages: int, storage=None, **kw) -> HierarchicalCache:
        pool = HostKVPool(GEOMETRIES[name], pages, "page_first")
        cache = HierarchicalCache(pool, storage, **kw)
        made.append((cache, pool))
        return cache

    yield make
    for cache, pool in made:
        cache.check_integrity()
        cache.close()
        pool.close()


def host_bytes(cache: HierarchicalCache, k: bytes) -> bytes:
    page = cache.index.page_of(k)
    assert page is not None
    return cache.pool.read_page(page).numpy().tobytes()


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_eviction_order_and_pins(build, name):
    g = GEOMETRIES[name]
    cache = build(name, 4)
    assert cache.put([key(i) for i in range(4)], [payload(g, i) for i in range(4)])  # LRU: 3, 2, 1, 0
    cache.check_integrity()
    got = cache.load([key(0)])  # a use: 0 stays most recent
    assert got.sources == ["host"] and host_bytes(cache, key(0)) == payload(g, 0)
    cache.release(got.keys)
    cache.pin([key(1)])
    assert cache.put([key(4), key(5)], [payload(g, 4), payload(g, 5)])  # evicts 3 then 2
    cache.check_integrity()
    assert cache.lookup([key(i) for i in range(6)]) == ["host", "host", "none", "none", "host", "host"]
    res = cache.reserve([key(0), key(6)])  # LRU is 0, 5, 4: evicts 5, never 0 (in this batch)
    assert res is not None and res.existing == [(key(0), cache.index.page_of(key(0)))] and len(res.new) == 1
    assert key(5) not in cache.index
    cache.pool.write_page(res.new[0][1], payload(g, 6))
    cache.commit(res)
    held = cache.load([key(0), key(4), key(6)])
    assert held.keys == [key(0), key(4), key(6)]
    assert cache.reserve([key(7)]) is None  # 1 pinned, 0/4/6 referenced: no room, nothing taken
    cache.check_integrity()
    cache.unpin([key(1)])  # rejoins the LRU order before the released keys
    cache.release(held.keys)
    assert cache.evict(1) == 1 and key(1) not in cache.index
    for i in (0, 4, 6):
        assert host_bytes(cache, key(i)) == payload(g, i)
    cache.check_integrity()


def test_bad_input(build, tmp_path):
    cache = build("mimo_kv", 2)
    with pytest.raises(ValueError, match="duplicate keys"):
        cache.reserve([key(1), key(1)])
    with pytest.raises(ValueError, match="non-empty bytes"):
        cache.load([b""])
    with pytest.raises(ValueError, match="'write_around'"):
        build("mimo_kv", 2, write_policy="write_around")
    with pytest.raises(ValueError, match="'eager'"):
        cache.prefetch([key(1)], policy="eager")
    other = make_tier("file", {"dir": str(tmp_path)}, identity(GEOMETRIES["mimo_fp4"]))
    with pytest.raises(ValueError, match="storage tier is for geometry"):
        build("mimo_kv", 2, other)
    res = cache.reserve([key(1)])
    cache.commit(res)
    with pytest.raises(ValueError, match="not reserved for an offload"):
        cache.commit(res)
    with pytest.raises(KeyError, match="not resident"):
        cache.pin([key(1), key(2)])
    assert cache.index.pins(key(1)) == 0  # nothing half-pinned


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_write_through(build, name):
    g = GEOMETRIES[name]
    tier = MemoryTier(identity(g))
    cache = build(name, 4, tier, write_policy="write_through")
    assert cache.put([key(i) for i in range(3)], [payload(g, i) for i in range(3)])
    assert cache.flush(60)
    assert tier.pages == {key(i): payload(g, i) for i in range(3)}
    assert cache.stats()["writes_done"] == 3 and cache.stats()["write_queue_depth"] == 0
    assert cache.put([key(0)], [payload(g, 0)]) and cache.flush(60)  # already stored: no rewrite
    assert cache.stats()["writes_done"] == 3


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_write_through_selective(build, name):
    g = GEOMETRIES[name]
    tier = MemoryTier(identity(g))
    cache = build(name, 4, tier, write_policy="write_through_selective")
    assert cache.put([key(i) for i in range(3)], [payload(g, i) for i in range(3)])
    assert cache.flush(60) and tier.pages == {}  # first use: host only
    cache.release(cache.load([key(0)]).keys)  # second use of 0: a load
    assert cache.put([key(1)], [payload(g, 1)])  # second use of 1: offloaded again
    assert cache.flush(60)
    assert tier.pages == {key(0): payload(g, 0), key(1): payload(g, 1)}
    cache.release(cache.load([key(0)]).keys)  # third use: already stored
    assert cache.flush(60) and cache.stats()["writes_done"] == 2


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_write_back(build, name):
    g = GEOMETRIES[name]
    tier = MemoryTier(identity(g))
    cache = build(name, 2, tier, write_policy="write_back")
    assert cache.put([key(0), key(1)], [payload(g, 0), payload(g, 1)])
    assert cache.flush(60) and tier.pages == {}
    res = cache.reserve([key(2)])  # evicts 1 (the batch's tail): its bytes are captured before the page is reused
    assert res is not None and res.new[0][1] == 1
    cache.pool.write_page(res.new[0][1], payload(g, 2))
    cache.commit(res)
    assert cache.evict(5) == 2  # an explicit eviction stores too
    assert cache.flush(60)
    assert tier.pages == {key(i): payload(g, i) for i in range(3)}
    got = cache.load([key(0), key(1)])  # back from storage; evicting them again writes nothing
    assert got.sources == ["storage", "storage"]
    cache.release(got.keys)
    assert cache.evict(5) == 2 and cache.flush(60) and cache.stats()["writes_done"] == 3


def test_storage_writes_never_block_and_overflow_is_dropped(build):
    g = GEOMETRIES["mimo_fp4"]
    tier = MemoryTier(identity(g))
    tier.write_gate.clear()  # storage hangs
    cache = build("mimo_fp4", 8, tier, write_policy="write_through", max_write_queue=2, write_batch_pages=1)
    assert cache.put([key(i) for i in range(5)], [payload(g, i) for i in range(5)])  # returns at once
    s = cache.stats()
    assert s["writes_dropped"] == 3 and s["write_queue_depth"] == 2
    cache.check_integrity()  # dropped writes released their pages' references
    assert sum(cache.index.refs(key(i)) for i in range(5)) == 2
    tier.write_gate.set()
    assert cache.flush(60) and len(tier.pages) == 2 and cache.stats()["writes_done"] == 2


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_load_fetches_storage_only_keys_first(build, name):
    g = GEOMETRIES[name]
    tier = MemoryTier(identity(g))
    for i in range(1, 4):
        tier.set(key(i), payload(g, i))
    cache = build(name, 4, tier)
    assert cache.put([key(0)], [payload(g, 0)]) and cache.flush(60)
    assert cache.lookup([key(0), key(1), key(9), key(3)]) == ["host", "storage", "none", "storage"]
    got = cache.load([key(0), key(1), key(2), key(9), key(3)])
    assert got.keys == [key(0), key(1), key(2)] and got.sources == ["host", "storage", "storage"]
    for k, page, i in zip(got.keys, got.pages, range(3), strict=True):
        assert cache.pool.read_page(page).numpy().tobytes() == payload(g, i) and cache.index.refs(k) == 1
    cache.check_integrity()
    cache.release(got.keys)
    s = cache.stats()
    assert (s["host_hits"], s["host_misses"], s["storage_hits"], s["storage_misses"]) == (1, 4, 2, 2)


@pytest.mark.parametrize("backend", ["file", "redis"])
@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_real_backends_survive_a_host_restart(build, tmp_path, backend, name):
    g = GEOMETRIES[name]
    server = None
    if backend == "redis":
        server = RedisServer(tmp_path, unix=True)
        server.start()
    extra = {"dir": str(tmp_path)} if backend == "file" else {"url": server.url}
    try:
        first = build(name, 4, make_tier(backend, extra, identity(g)))
        assert first.put([key(i) for i in range(4)], [payload(g, i) for i in range(4)]) and first.flush(60)
        second = build(name, 4, make_tier(backend, extra, identity(g)))  # a new sidecar, empty host
        handle = second.prefetch([key(i) for i in range(5)], policy="wait_complete")
        result = handle.result()
        assert result.ready == 4 and result.status.done == 4 and not result.timed_out
        assert all(host_bytes(second, key(i)) == payload(g, i) for i in range(4))
        other_ns = build(name, 4, make_tier(backend, extra, identity(g, namespace="other")))
        assert other_ns.lookup([key(0)]) == ["none"]
    finally:
        if server is not None:
            server.stop()


def test_concurrent_offload_load_prefetch_evict_keep_integrity(build):
    import random
    import threading

    g = GEOMETRIES["mimo_fp4"]
    tier = MemoryTier(identity(g))
    cache = build("mimo_fp4", 12, tier, write_policy="write_back", write_batch_pages=3)
    data = {i: payload(g, i) for i in range(40)}
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                ks = rng.sample(range(40), rng.randint(1, 4))
                op = rng.random()
                if op < 0.4:
                    cache.put([key(i) for i in ks], [data[i] for i in ks])
                elif op < 0.7:
                    got = cache.load([key(i) for i in ks])
                    for k, page in zip(got.keys, got.pages, strict=True):
                        assert cache.pool.read_page(page).numpy().tobytes() == data[int.from_bytes(k[:4], "little")]
                    cache.release(got.keys)
                elif op < 0.9:
                    cache.prefetch([key(i) for i in ks]).result()
                else:
                    cache.evict(2)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert cache.flush(60)
    cache.check_integrity()
    for k, v in tier.pages.items():  # everything written back is exact
        assert v == data[int.from_bytes(k[:4], "little")]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("page_size", [4, 64])
def test_a_fetch_lands_exact_pages_in_every_layout(tmp_path, layout, page_size):
    """Straight into the host pages (page_pieces) where the pool gives them, through
    write_page where it does not (page_first at page 64: too many token rows)."""
    from conftest import load_config

    from hicache.geometry import KVGeometry
    from hicache.storage.file import FileTier

    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=page_size)
    tier = FileTier(identity(g), tmp_path, fsync=False)
    assert tier.batch_set([(key(i), payload(g, i)) for i in range(3)]) == [True] * 3
    pool = HostKVPool(g, 4, layout)
    assert (pool.page_pieces(0) is None) == (layout == "page_first" and page_size == 64)
    cache = HierarchicalCache(pool, tier)
    try:
        got = cache.load([key(2), key(0), key(1), key(7)])
        assert got.keys == [key(2), key(0), key(1)] and got.sources == ["storage"] * 3
        for page, i in zip(got.pages, (2, 0, 1), strict=True):
            assert pool.read_page(page).numpy().tobytes() == payload(g, i)
        cache.release(got.keys)
        cache.check_integrity()
    finally:
        cache.close()
        pool.close()


@pytest.mark.parametrize(
    ("layout", "page_size"), [("layer_first", 4), ("page_first", 4), ("page_first_direct", 4), ("page_first", 64)]
)
def test_pages_written_to_storage_are_exact_and_uncopied_where_the_pool_has_pieces(tmp_path, layout, page_size):
    """The writer hands a tier the host page's own pieces (no copy) where page_pieces gives
    them, and a copy (read_page) where it does not (page_first with too many token rows)."""
    import numpy as np
    from conftest import load_config

    from hicache.cache.writer import WriteJob
    from hicache.geometry import KVGeometry
    from hicache.storage.file import FileTier

    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=page_size)
    tier = FileTier(identity(g), tmp_path, fsync=False)
    pool = HostKVPool(g, 4, layout)
    cache = HierarchicalCache(pool, tier)  # write_through: every put is stored
    try:
        assert cache.put([key(i) for i in range(3)], [payload(g, i) for i in range(3)]) and cache.flush(60)
        assert all(bytes(tier.get(key(i)) or b"") == payload(g, i) for i in range(3))
        page = cache.index.page_of(key(1))
        assert page is not None
        data = cache._read_job(WriteJob(key(1), page))  # what the writer hands the tier
        parts = data if isinstance(data, list) else [data]
        assert b"".join(bytes(p) for p in parts) == payload(g, 1)
        shares = [np.shares_memory(np.frombuffer(p, dtype=np.uint8), pool.flat.numpy()) for p in parts]
        has_pieces = pool.page_pieces(page) is not None
        assert has_pieces == (page_size == 4) and isinstance(data, list) == has_pieces
        assert all(shares) == has_pieces and any(shares) == has_pieces  # the pool's own bytes, or a copy
    finally:
        cache.close()
        pool.close()


def test_a_host_shrink_leaves_the_cache_consistent(build):
    g = GEOMETRIES["mimo_kv"]
    cache = build("mimo_kv", 4, MemoryTier(identity(g)))
    ks = [key(i) for i in range(4)]
    assert cache.put(ks, [payload(g, i) for i in range(4)]) and cache.flush(30)
    cache.pin([ks[3]])
    page = cache.index.page_of(ks[3])
    assert page is not None and page >= 1
    retired = cache.resize_host(1)
    cache.check_integrity()  # the retired pages are neither free nor reserved
    assert page not in retired and ks[3] in cache.index
    cache.unpin([ks[3]])  # released above the line: dropped, and forgotten by the cache
    assert ks[3] not in cache.index
    cache.check_integrity()
    assert cache.lookup([ks[3]]) == ["storage"]
    assert cache.resize_host(1) == [page]


def test_a_key_bound_above_a_shrunken_line_stays_resident_through_reserve(build):
    g = GEOMETRIES["mimo_kv"]
    cache = build("mimo_kv", 4, MemoryTier(identity(g)), write_policy="write_through_selective")
    ks = [key(i) for i in range(3)]
    assert cache.put([ks[0]], [payload(g, 0)])
    res = cache.reserve([ks[1]])  # a copy in flight across the shrink
    assert res is not None
    ((_, page),) = res.new
    cache.pool.write_page(page, payload(g, 1))
    cache.resize_host(1)
    assert page >= 1
    cache.commit(res)  # bound above the line
    again = cache.reserve([ks[1], ks[2]], partial=True)
    assert again is not None and again.existing == [(ks[1], page)] and ks[1] in cache.index
    assert host_bytes(cache, ks[1]) == payload(g, 1)
    cache.abort(again)
    cache.check_integrity()
    assert cache.flush(30)
    assert cache.resize_host(1) == [page] and ks[1] not in cache.index  # its page goes back at last


def test_a_burst_waits_for_a_slow_tier_that_keeps_writing_and_drops_nothing(build):
    g = GEOMETRIES["mimo_fp4"]

    class SlowTier(MemoryTier):
        def batch_set(self, items):  # type: ignore[no-untyped-def]
            time.sleep(0.005)  # a disk slower than the offloads, but writing
            return super().batch_set(items)

    tier = SlowTier(identity(g))
    cache = build("mimo_fp4", 64, tier, write_policy="write_through", max_write_queue=2, write_batch_pages=1)
    assert cache.put([key(i) for i in range(40)], [payload(g, i) for i in range(40)])
    assert cache.flush(60)
    s = cache.stats()
    assert s["writes_dropped"] == 0 and s["writes_done"] == 40 and len(tier.pages) == 40
    cache.check_integrity()
