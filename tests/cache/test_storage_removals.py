"""write_back never loses a page from both tiers: a key the storage tier drops (its cap, a
corrupt file, another pool's delete) while it is on host is written back when the host
evicts it, also when the drop lands while the key is being fetched."""

from collections.abc import Iterator

import pytest
from tier_helpers import GEOMETRIES, MemoryTier, identity, key, payload

from hicache.cache.tiering import HierarchicalCache
from hicache.pools import HostKVPool
from hicache.storage import page_format as fmt
from hicache.storage.file import FileTier

G = GEOMETRIES["mimo_kv"]
PAGE = fmt.stored_size(identity(G), key(0))


@pytest.fixture
def write_back(tmp_path) -> Iterator:
    """make(tier) -> a write_back cache of 2 host pages over `tier`; a FileTier holding 2 pages."""
    made: list[tuple[HierarchicalCache, HostKVPool]] = []

    def make(tier: FileTier) -> HierarchicalCache:
        pool = HostKVPool(G, 2, "page_first")
        cache = HierarchicalCache(pool, tier, write_policy="write_back")
        made.append((cache, pool))
        return cache

    yield make, FileTier(identity(G), tmp_path, fsync=False, max_bytes=2 * PAGE)
    for cache, pool in made:
        cache.check_integrity()
        cache.close()
        pool.close()


def load_from_storage(cache: HierarchicalCache, k: bytes) -> None:
    got = cache.load([k])
    assert got.sources == ["storage"]
    cache.release(got.keys)


def dropped_by_cap(tier: FileTier, k: bytes) -> None:
    assert tier.batch_set([(key(8), payload(G, 8)), (key(9), payload(G, 9))]) == [True, True]


def dropped_as_corrupt(tier: FileTier, k: bytes) -> None:
    path = tier.path_of(k)
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")  # the checksum fails: the read deletes it
    assert tier.get(k) is None


def deleted_by_another_pool(tier: FileTier, k: bytes) -> None:
    assert tier.delete(k)


@pytest.mark.parametrize("drop", [dropped_by_cap, dropped_as_corrupt, deleted_by_another_pool])
def test_a_key_the_tier_dropped_is_written_back_at_host_eviction(write_back, drop):
    make, tier = write_back
    assert tier.set(key(1), payload(G, 1))
    cache = make(tier)
    load_from_storage(cache, key(1))  # on host, known to be stored
    drop(tier, key(1))
    assert not tier.contains(key(1))
    assert cache.evict(2) == 1 and cache.flush(60)
    assert bytes(tier.get(key(1))) == payload(G, 1)
    assert cache.lookup([key(1)]) == ["storage"]


def test_a_key_dropped_between_its_fetch_and_its_bind_is_written_back(write_back, monkeypatch):
    make, tier = write_back
    assert tier.set(key(1), payload(G, 1))
    cache = make(tier)
    reads = {name: getattr(tier, name) for name in ("batch_read", "batch_read_into")}

    def read_then_delete(name):  # type: ignore[no-untyped-def]
        def read(keys, into):  # type: ignore[no-untyped-def]
            n = reads[name](keys, into)
            tier.delete(keys[0])  # another pool deletes it after the read, before the cache binds it
            return n

        return read

    for name in reads:
        monkeypatch.setattr(tier, name, read_then_delete(name))
    load_from_storage(cache, key(1))
    monkeypatch.undo()
    assert not tier.contains(key(1))
    assert cache.evict(2) == 1 and cache.flush(60)
    assert bytes(tier.get(key(1))) == payload(G, 1)


def test_a_closed_cache_stops_watching_its_tier(write_back):
    make, tier = write_back
    first, second = make(tier), make(tier)
    assert len(tier._watchers) == 2
    first.close()
    second.close()
    assert tier._watchers == ()


class ForgetfulTier(MemoryTier):
    """A tier whose backend drops keys unannounced (as Redis does with a TTL or maxmemory)."""

    forgets_on_its_own = True

    def __init__(self) -> None:
        super().__init__(identity(G))
        self.written: list[bytes] = []

    def batch_set(self, items):  # type: ignore[no-untyped-def]
        self.written += [k for k, _ in items]
        return super().batch_set(items)


@pytest.mark.parametrize("forgotten", [True, False])
def test_a_tier_that_forgets_on_its_own_is_asked_before_a_known_key_is_written_back(forgotten):
    """write_back trusted that a key read from storage was still there at host eviction; a
    Redis TTL or maxmemory eviction in between lost the page from both tiers. Now the writer
    asks the tier, and writes the page only if it is gone."""
    tier = ForgetfulTier()
    assert tier.set(key(1), payload(G, 1))
    pool = HostKVPool(G, 2, "page_first")
    cache = HierarchicalCache(pool, tier, write_policy="write_back")
    try:
        load_from_storage(cache, key(1))  # on host, known to be stored
        if forgotten:
            del tier.pages[key(1)]  # expired: the tier is not told
        assert cache.evict(2) == 1 and cache.flush(60)
        assert bytes(tier.get(key(1))) == payload(G, 1)
        assert tier.written == ([key(1)] if forgotten else [])  # still there: not written again
        assert cache.lookup([key(1)]) == ["storage"]
        cache.check_integrity()
    finally:
        cache.close()
        pool.close()


def test_write_back_over_redis_writes_back_a_page_redis_evicted_on_its_own(redis_server):
    from hicache.storage.redis import RedisTier

    tier = RedisTier(identity(G), redis_server.url)
    assert tier.set(key(1), payload(G, 1))
    pool = HostKVPool(G, 2, "page_first")
    cache = HierarchicalCache(pool, tier, write_policy="write_back")
    try:
        load_from_storage(cache, key(1))
        assert redis_server.client().delete(tier.qualified(key(1))) == 1  # as maxmemory would
        assert cache.evict(2) == 1 and cache.flush(60)
        assert bytes(tier.get(key(1))) == payload(G, 1)  # before: lost from both tiers
    finally:
        cache.close()
        pool.close()
        tier.close()
