"""Behaviour every storage tier shares, run on the file and redis tiers for every geometry."""

import threading
from collections.abc import Callable, Iterator

import pytest
from tier_helpers import GEOMETRIES, GEOMETRY_NAMES, RedisServer, identity, key, payload

from hicache.geometry import KVGeometry
from hicache.storage import StorageTier, TierIdentity, make_tier
from hicache.storage import page_format as fmt
from hicache.storage.factory import check_extra
from hicache.storage.redis import PARALLEL_HASH_BYTES, RedisTier

MakeTier = Callable[[TierIdentity], StorageTier]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), unix=True)
    server.start()
    yield server.url
    server.stop()


@pytest.fixture(params=["file", "redis", "redis-cluster"])
def make(request, tmp_path) -> Iterator[MakeTier]:
    tiers: list[StorageTier] = []
    extra = {
        "file": lambda: {"dir": str(tmp_path)},
        "redis": lambda: {"url": request.getfixturevalue("redis_url")},
        "redis-cluster": lambda: {"url": request.getfixturevalue("redis_cluster").url},
    }[request.param]()

    def build(ident: TierIdentity) -> StorageTier:
        tier = make_tier(request.param, extra, ident)
        tiers.append(tier)
        return tier

    yield build
    for t in tiers:
        t.check_integrity()
        t.close()
    if request.param == "redis":
        RedisServer.flush(extra["url"])
    if request.param == "redis-cluster":
        request.getfixturevalue("redis_cluster").flush()


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_set_get_exists_delete(make, name):
    g = GEOMETRIES[name]
    tier = make(identity(g))
    pages = {key(i): payload(g, i) for i in range(5)}
    assert tier.batch_set(list(pages.items())[:4]) == [True] * 4
    assert tier.set(key(4), pages[key(4)])
    keys = list(pages)
    assert tier.batch_exists(keys) == 5
    assert tier.batch_exists([key(0), key(1), key(99), key(2)]) == 2
    assert tier.batch_contains([key(99), key(3)]) == [False, True]
    assert tier.exists(key(2)) and not tier.exists(key(99))
    got = tier.batch_get(keys + [key(99)])
    assert [bytes(x) if x is not None else None for x in got] == list(pages.values()) + [None]
    assert tier.delete(key(2)) and not tier.delete(key(2))
    assert tier.get(key(2)) is None and tier.batch_exists(keys) == 2
    tier.check_integrity()
    s = tier.stats()
    assert (s.hits, s.misses, s.writes, s.deletes, s.corrupt) == (5, 2, 5, 1, 0)
    assert s.bytes_written == 5 * g.page_bytes and s.healthy and tier.health().healthy


def test_overwrite_and_bad_input(make):
    g = GEOMETRIES["mimo_fp4"]
    tier = make(identity(g))
    assert tier.set(key(1), payload(g, 1)) and tier.set(key(1), payload(g, 2))
    assert bytes(tier.get(key(1))) == payload(g, 2)
    with pytest.raises(ValueError, match=f"must be {g.page_bytes} bytes"):
        tier.batch_set([(key(2), payload(g, 2)), (key(3), b"short")])
    assert not tier.exists(key(2))  # nothing of a rejected batch was stored
    with pytest.raises(ValueError, match="1..64 bytes"):
        tier.get(b"")


def test_geometry_model_namespace_isolation(make):
    g = GEOMETRIES["mimo_kv"]
    other_g = GEOMETRIES["mimo_fp4"]
    a = make(identity(g, namespace="tenant-a"))
    assert a.set(key(1), payload(g, 1))
    for other in (identity(g, namespace="tenant-b"), identity(g, model="test-model@rev2"), identity(other_g)):
        b = make(other)
        assert b.batch_exists([key(1)]) == 0 and b.get(key(1)) is None
    same = make(identity(g, namespace="tenant-a"))
    if same.backend == "redis":  # a second instance sharing the server sees the page
        assert bytes(same.get(key(1))) == payload(g, 1)


def test_factory_errors(tmp_path):
    ident = identity(GEOMETRIES["mimo_kv"])
    with pytest.raises(ValueError, match="'nfs'"):
        make_tier("nfs", {}, ident)
    with pytest.raises(ValueError, match=r"\['path'\]"):
        make_tier("file", {"path": "x"}, ident)
    with pytest.raises(ValueError, match='needs "url"'):
        check_extra("redis", {})
    with pytest.raises(ValueError, match="max_bytes"):
        make_tier("file", {"dir": str(tmp_path), "max_bytes": -1}, ident)
    with pytest.raises(ValueError, match="ftp://x"):
        make_tier("redis", {"url": "ftp://x"}, ident)
    none = make_tier("none", {}, ident)
    assert not none.enabled and not none.set(key(1), payload(GEOMETRIES["mimo_kv"], 1))
    assert none.get(key(1)) is None and none.batch_exists([key(1)]) == 0


def scattered(g, count: int, cuts: tuple[int, ...]) -> tuple[bytearray, list[list[memoryview]], list[list[int]]]:
    """Per page, writable pieces of one buffer cut at `cuts`, with 7-byte gaps between
    them: (the buffer, each page's pieces, each page's piece offsets in the buffer)."""
    sizes = [b - a for a, b in zip((0, *cuts), (*cuts, g.page_bytes), strict=True)]
    memory = bytearray(count * (g.page_bytes + 7 * len(sizes)))
    view, at, pages, offsets = memoryview(memory), 0, [], []
    for _ in range(count):
        pages.append([])
        offsets.append([])
        for n in sizes:
            pages[-1].append(view[at : at + n])
            offsets[-1].append(at)
            at += n + 7
    return memory, pages, offsets


def test_batch_read_into_fills_the_pieces_in_order_and_stops_at_a_miss(make):
    g = GEOMETRIES["mimo_kv"]
    tier = make(identity(g))
    assert tier.batch_set([(key(i), payload(g, i)) for i in range(3)]) == [True] * 3
    memory, pages, offsets = scattered(g, 4, (1, 100, g.page_bytes // 2))
    assert tier.batch_read_into([key(0), key(2), key(1), key(9)], pages.__getitem__) == 3
    expected = bytearray(len(memory))  # the payloads at the pieces' places; gaps and the missed page zero
    for slot, i in enumerate((0, 2, 1)):
        data, at = payload(g, i), 0
        for piece, offset in zip(pages[slot], offsets[slot], strict=True):
            expected[offset : offset + piece.nbytes] = data[at : at + piece.nbytes]
            at += piece.nbytes
    assert memory == expected
    assert tier.stats().hits == 3
    with pytest.raises(ValueError, match=f"add up to {g.page_bytes - 1} bytes, not the page's {g.page_bytes}"):
        tier.batch_read_into([key(0)], lambda i: [pages[0][0], pages[0][1], pages[0][2], pages[0][3][1:]])
    with pytest.raises(ValueError, match="writable contiguous byte view"):
        tier.batch_read_into([key(0)], lambda i: [memoryview(payload(g, 0))])


def test_a_page_given_as_pieces_is_stored_as_their_concatenation(make):
    """batch_set takes a page as a list of buffers (a host page's pieces) and stores them
    back to back, never joined by the caller; a bad total is refused before anything is stored."""
    g = GEOMETRIES["mimo_kv"]
    tier = make(identity(g))
    whole = [payload(g, i) for i in range(3)]
    cuts = (0, 1, 100, g.page_bytes // 2, g.page_bytes)
    as_pieces = [[memoryview(p)[a:b] for a, b in zip(cuts, cuts[1:], strict=False)] for p in whole]
    assert tier.batch_set([(key(0), as_pieces[0]), (key(1), whole[1]), (key(2), [bytearray(whole[2])])]) == [True] * 3
    assert [bytes(tier.get(key(i)) or b"") for i in range(3)] == whole
    short = [memoryview(whole[0])[:100], memoryview(whole[0])[200:]]
    with pytest.raises(ValueError, match=f"must be {g.page_bytes} bytes.*got {g.page_bytes - 100}"):
        tier.batch_set([(key(5), whole[0]), (key(6), short)])
    with pytest.raises(ValueError, match=f"must be {g.page_bytes} bytes.*got 0"):
        tier.set(key(7), [])
    assert tier.batch_exists([key(5)]) == 0 and not tier.exists(key(6))


def test_a_batch_of_large_pages_is_checked_whole_then_stored(make):
    """Pages of a MiB or more (checksummed several at once where the C hash runs without the
    GIL: the Redis tiers) are stored as given; one bad page refuses the whole batch, naming
    it, with nothing stored."""
    g = KVGeometry(layer_num=9, head_num=4, head_dim=192, v_head_dim=128, page_size=64)  # 1.47 MB pages
    assert g.page_bytes >= PARALLEL_HASH_BYTES
    tier = make(identity(g))
    pages = [(key(i), payload(g, i)) for i in range(5)]
    bad = pages[:3] + [(key(3), pages[3][1][:-1])] + pages[4:]
    with pytest.raises(ValueError, match=f"must be {g.page_bytes} bytes.*got {g.page_bytes - 1}"):
        tier.batch_set(bad)
    assert tier.batch_exists([k for k, _ in pages]) == 0
    assert tier.batch_set(pages) == [True] * 5
    assert [bytes(tier.get(k) or b"") for k, _ in pages] == [p for _, p in pages]
    if isinstance(tier, RedisTier) and fmt.hashes_without_gil():  # the pages went through the hash threads
        assert any(t.name.startswith("hicache-redis-hash") for t in threading.enumerate())
