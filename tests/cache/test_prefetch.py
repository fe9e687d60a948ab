"""Prefetch policies, with a storage stub that only delays (no timed assertions)."""

import math
import threading
from collections.abc import Iterator

import pytest
from tier_helpers import GEOMETRIES, GEOMETRY_NAMES, MemoryTier, identity, key, payload

from hicache.cache.policies import PrefetchTimeout
from hicache.cache.tiering import HierarchicalCache
from hicache.pools import HostKVPool


@pytest.fixture
def setup() -> Iterator:
    made: list[tuple[HierarchicalCache, HostKVPool, MemoryTier]] = []

    def make(name: str, stored: int, pages: int = 8, **kw) -> tuple[HierarchicalCache, MemoryTier]:
        g = GEOMETRIES[name]
        tier = MemoryTier(identity(g))
        for i in range(stored):
            tier.set(key(i), payload(g, i))
        pool = HostKVPool(g, pages, "layer_first")
        cache = HierarchicalCache(pool, tier, fetch_batch_pages=2, **kw)
        made.append((cache, pool, tier))
        return cache, tier

    yield make
    for cache, pool, tier in made:
        tier.read_gate.set()
        cache.close()
        cache.check_integrity()
        pool.close()


def exact(cache: HierarchicalCache, upto: int) -> bool:
    g = cache.geometry
    for i in range(upto):
        page = cache.index.page_of(key(i))
        if page is None or cache.pool.read_page(page).numpy().tobytes() != payload(g, i):
            return False
    return True


def test_timeout_rule():
    t = PrefetchTimeout(base_s=1, per_ki_token_s=0.5, max_s=3)
    assert (t.seconds(0), t.seconds(1024), t.seconds(2048), t.seconds(10**6)) == (1, 1.5, 2, 3)
    with pytest.raises(ValueError, match="max_s 0.5 is below base_s 1"):
        PrefetchTimeout(base_s=1, max_s=0.5)
    with pytest.raises(ValueError, match="per_ki_token_s must be a finite number >= 0, got -1"):
        PrefetchTimeout(per_ki_token_s=-1)
    for bad in (math.nan, math.inf):  # a NaN allowance would never expire, nor compare
        with pytest.raises(ValueError, match=f"base_s must be a finite number >= 0, got {bad}"):
            PrefetchTimeout(base_s=bad, max_s=math.inf)


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_best_effort_takes_what_is_there_and_cancels_the_rest(setup, name):
    cache, tier = setup(name, stored=6, prefetch_policy="best_effort")
    tier.read_gate.clear()
    assert cache.put([key(0)], [payload(cache.geometry, 0)])
    handle = cache.prefetch([key(i) for i in range(8)])
    assert handle.status().total == 5  # 1..5: 0 is on host, 6 and 7 are nowhere
    tier.reads_started.acquire()  # the worker is inside its first batch (keys 1, 2)
    result = handle.result()  # does not wait
    assert result.ready == 1 and not result.timed_out and result.status.cancelled
    tier.read_gate.set()
    assert handle.wait(60)
    status = handle.status()
    assert status.finished and status.done == 2 and status.failed == 3  # only the batch in flight landed
    assert cache.lookup([key(i) for i in range(4)]) == ["host", "host", "host", "storage"]
    assert exact(cache, 3)
    cache.check_integrity()


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_wait_complete_waits_for_every_page(setup, name):
    cache, tier = setup(name, stored=5, prefetch_policy="wait_complete")
    tier.read_gate.clear()
    handle = cache.prefetch([key(i) for i in range(6)])
    results = []
    waiter = threading.Thread(target=lambda: results.append(handle.result()))
    waiter.start()
    tier.reads_started.acquire()
    waiter.join(0.05)
    assert waiter.is_alive() and not handle.status().finished  # storage is held: it must still wait
    tier.read_gate.set()
    waiter.join(60)
    (result,) = results
    assert result.ready == 5 and result.status.done == 5 and result.status.failed == 0
    assert exact(cache, 5) and cache.stats()["prefetch_pages"] == 5
    cache.check_integrity()


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_timeout_gives_up_after_the_allowance(setup, name):
    fast = PrefetchTimeout(base_s=0.01, per_ki_token_s=0, max_s=0.01)
    cache, tier = setup(name, stored=4, prefetch_policy="timeout", prefetch_timeout=fast)
    tier.read_gate.clear()  # storage never answers within the allowance
    handle = cache.prefetch([key(i) for i in range(4)])
    result = handle.result()
    assert result.timed_out and result.ready == 0 and result.status.cancelled
    tier.read_gate.set()
    assert handle.wait(60) and handle.status().done <= 2
    cache.check_integrity()
    # a generous allowance behaves like wait_complete; it also waits for an overlapping prefetch
    tier.read_gate.clear()
    cache.prefetch_timeout = PrefetchTimeout(base_s=60, max_s=60)
    other = cache.prefetch([key(i) for i in range(3)], policy="best_effort")
    again = cache.prefetch([key(i) for i in range(4)], policy="timeout")
    assert again.status().total + other.status().total == 4 - handle.status().done
    tier.read_gate.set()
    result = again.result()
    assert not result.timed_out and result.ready == 4 and exact(cache, 4)
    cache.prefetch_timeout = PrefetchTimeout(base_s=60, max_s=60)
    again = cache.prefetch([key(i) for i in range(4)], policy="timeout")
    result = again.result()
    assert not result.timed_out and result.ready == 4 and exact(cache, 4)


def test_progress_is_observable_batch_by_batch(setup):
    cache, tier = setup("mimo_kv", stored=6, prefetch_policy="wait_complete")
    tier.permits = threading.Semaphore(0)
    handle = cache.prefetch([key(i) for i in range(6)])
    seen = [handle.status()]
    assert (seen[0].total, seen[0].done, seen[0].finished) == (6, 0, False)
    while not seen[-1].finished:  # three batches of two pages; let one through at a time
        tier.permits.release()
        seen.append(handle.wait_for_update(seen[-1], timeout=60))
    assert [s.done for s in seen] == [0, 2, 4, 6] or [s.done for s in seen] == [0, 2, 4, 6, 6]
    assert seen[-1].finished and seen[-1].failed == 0


def test_prefetch_and_load_meet_and_host_space_limits(setup):
    cache, tier = setup("deepseek_mla", stored=6, pages=4)
    tier.read_gate.clear()
    handle = cache.prefetch([key(i) for i in range(6)])
    assert handle.status().total == 4  # only 4 host pages
    loader_out = []
    loader = threading.Thread(target=lambda: loader_out.append(cache.load([key(0), key(1)])))
    loader.start()  # waits for the prefetch that is filling its keys
    tier.read_gate.set()
    loader.join(60)
    (got,) = loader_out
    assert got.sources == ["host", "host"] and exact(cache, 4)
    cache.release(got.keys)
    assert handle.result().ready == 4
    empty = cache.prefetch([key(9)])
    assert empty.status().finished and empty.status().total == 0 and empty.result().ready == 0
    cache.check_integrity()


def test_a_key_dropped_while_a_later_batch_reads_fails_nothing(setup, caplog):
    cache, tier = setup("mimo_kv", stored=4, prefetch_policy="wait_complete")
    tier.permits = threading.Semaphore(1)  # the first batch (keys 0 and 1) reads, the second waits
    handle = cache.prefetch([key(i) for i in range(4)])
    status = handle.status()
    while status.done < 2:
        status = handle.wait_for_update(status, timeout=60)
    assert cache.drop([key(1)]) == ["evicted"]
    tier.permits.release()
    result = handle.result()
    assert result.status.done == 4 and result.status.failed == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no "storage fetch failed"
    assert cache.evict(1) == 1 and key(0) in cache.index  # every key left was touched, head last
