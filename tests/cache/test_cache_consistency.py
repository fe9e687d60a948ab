"""The host cache stays consistent when chains mix tiers, storage fails, or calls are refused."""

import threading
import time

import pytest
from tier_helpers import GEOMETRIES, MemoryTier, identity, key, payload

from hicache.cache.tiering import HierarchicalCache
from hicache.pools import HostKVPool
from hicache.sidecar.request_cache import RequestCache

G = GEOMETRIES["mimo_kv"]


@pytest.fixture
def cache_with_tier():
    made = []

    def make(pages: int, *, storage: bool = True, **kw):
        tier = MemoryTier(identity(G))
        pool = HostKVPool(G, pages, "page_first")
        cache = HierarchicalCache(pool, tier if storage else None, **kw)
        made.append((cache, pool))
        return cache, tier

    yield make
    for cache, pool in made:
        cache.check_integrity()
        cache.close()
        pool.close()


def test_load_serves_a_chain_whose_head_is_only_in_storage(cache_with_tier):
    cache, _ = cache_with_tier(4, write_policy="write_through")
    chain = [key(i) for i in range(4)]
    assert cache.put(chain, [payload(G, i) for i in range(4)]) and cache.flush(30)
    cache.drop([chain[0], chain[2]])  # host: _ 1 _ 3, storage: all
    got = cache.load(chain)
    assert got.keys == chain and got.sources == ["storage", "host", "storage", "host"]
    assert all(cache.pool.read_page(p).numpy().tobytes() == payload(G, i) for i, p in enumerate(got.pages))
    cache.release(got.keys)
    assert cache.stats()["storage_hits"] == 2 and cache.stats()["host_hits"] == 2


def test_a_failing_storage_read_fails_its_prefetch_not_the_worker(cache_with_tier):
    cache, tier = cache_with_tier(8, write_policy="write_through")
    ks = [key(i) for i in range(4)]
    assert cache.put(ks, [payload(G, i) for i in range(4)]) and cache.flush(30)
    for k in ks:
        cache.drop([k])
    tier.failures = [True]
    first = cache.prefetch(ks[:2], "wait_complete").result()
    assert first.status.done == 0 and first.status.failed == 2
    second = cache.prefetch(ks[2:], "wait_complete").result()  # the worker is still alive
    assert second.status.done == 2 and cache.lookup(ks) == ["storage", "storage", "host", "host"]
    got = cache.load(ks)  # nothing left pending: load does not wait forever
    assert got.keys == ks and got.sources == ["storage", "storage", "host", "host"]
    cache.release(got.keys)


def test_a_load_whose_fetch_fails_part_way_holds_no_reference(cache_with_tier):
    cache, tier = cache_with_tier(8, write_policy="write_through", fetch_batch_pages=2)
    ks = [key(i) for i in range(4)]
    assert cache.put(ks, [payload(G, i) for i in range(4)]) and cache.flush(30)
    cache.drop(ks)
    tier.failures = [False, True]  # the second batch of two fails
    with pytest.raises(OSError, match="injected"):
        cache.load(ks)
    assert [cache.index.refs(k) for k in ks[:2]] == [0, 0]  # fetched, resident, not held
    assert cache.evict(8) == 2  # so they can go again


def test_a_chain_loses_its_tail_first(cache_with_tier):
    cache, _ = cache_with_tier(4, storage=False)
    chain = [key(i) for i in range(4)]
    assert cache.put(chain, [payload(G, i) for i in range(4)])
    got = cache.load(chain)
    cache.release(got.keys)
    assert cache.put([key(9)], [payload(G, 9)])  # evicts one page: the tail, never the head
    assert cache.lookup(chain) == ["host", "host", "host", "none"]
    assert cache.index.prefix_length(chain) == 3


def test_failed_release_unpin_and_remove_change_nothing(cache_with_tier):
    cache, _ = cache_with_tier(4, storage=False)
    a, b, c = key(0), key(1), key(2)
    assert cache.put([a, b, c], [payload(G, i) for i in range(3)])
    cache.pin([b])
    with pytest.raises(ValueError, match="pinned or in use"):
        cache.remove([a, b])
    assert a in cache.index and b in cache.index
    got = cache.load([c])
    with pytest.raises(ValueError, match="not referenced"):
        cache.release([c, b])
    assert cache.index.refs(c) == 1
    cache.release(got.keys)
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin([b, c])
    assert cache.index.pins(b) == 1
    cache.unpin([b])
    assert cache.remove([a, b]) == 2


def test_request_cache_keeps_running_attempts_past_capacity():
    rc = RequestCache(capacity=2)
    runs: list[str] = []
    gate = threading.Event()

    def slow() -> str:
        runs.append("A")
        assert gate.wait(30)
        return "answer-A"

    first = threading.Thread(target=lambda: rc.run(("pin", "p"), "A", "d", slow))
    first.start()
    while not runs:
        time.sleep(0.001)
    for rid in ("B", "C", "D"):  # more finished calls than the capacity while A runs
        rc.run(("pin", "p"), rid, "d", lambda rid=rid: rid)
    answers: list[str] = []
    retry = threading.Thread(target=lambda: answers.append(rc.run(("pin", "p"), "A", "d", lambda: "rerun")))
    retry.start()
    time.sleep(0.05)
    gate.set()
    first.join(30)
    retry.join(30)
    assert runs == ["A"] and answers == ["answer-A"]  # the retry waited for the first attempt
    assert len(rc) == 2


def test_request_cache_failed_attempt_does_not_drop_a_newer_slot():
    rc = RequestCache(capacity=4)

    def boom() -> str:
        raise RuntimeError("first attempt fails")

    with pytest.raises(RuntimeError):
        rc.run(("pin", "p"), "A", "d", boom)
    assert rc.run(("pin", "p"), "A", "d", lambda: "second") == "second"
    assert rc.run(("pin", "p"), "A", "d", lambda: "third") == "second"  # answered from the cache


def test_a_stale_reservation_cannot_end_a_newer_one(cache_with_tier):
    cache, _ = cache_with_tier(2, storage=False)
    k = key(0)
    first = cache.reserve([k])
    assert first is not None
    cache.pool.write_page(first.new[0][1], payload(G, 0))
    cache.commit(first)
    cache.evict(1)
    second = cache.reserve([k])  # another offload of the same key, its copy still running
    assert second is not None
    with pytest.raises(ValueError, match="not reserved for an offload"):
        cache.abort(first)  # already committed: refused, and second's page is not given back
    cache.pool.write_page(second.new[0][1], payload(G, 0))
    cache.commit(second)
    assert cache.lookup([k]) == ["host"]
