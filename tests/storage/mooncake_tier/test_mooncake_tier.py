"""The Mooncake tier against a real master: what it stores, how it reads, and what a hostile
or damaged object under one of its keys comes to (a miss, removed and counted; never served)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest
from mooncake.store import MooncakeDistributedStore
from tier_helpers import GEOMETRIES, GEOMETRY_NAMES, identity, key, payload

from hicache.demo.mooncake_local import LocalMooncakeMaster
from hicache.storage import page_format as fmt
from hicache.storage.mooncake import MooncakeTier
from hicache.storage.mooncake_link import close_links


@pytest.fixture
def raw(master: LocalMooncakeMaster) -> Iterator[MooncakeDistributedStore]:
    """Another Mooncake client on the same cluster: what a hostile or buggy writer does."""
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", master.address) == 0
    yield store
    store.close()


@pytest.mark.parametrize("direct", [True, False], ids=["zero-copy", "staged"])
@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_pages_round_trip_zero_copy_and_staged(mooncake, name, direct):
    """Over TCP pages go straight between Mooncake and the caller's buffers; the staged path
    (RDMA's: through a registered buffer) stores the same objects."""
    g = GEOMETRIES[name]
    tier = mooncake(identity(g))
    tier.direct = direct
    pages = [(key(i), payload(g, i)) for i in range(6)]
    assert tier.batch_set(pages) == [True] * 6, tier.stats().last_error
    other = mooncake(identity(g), local_buffer_size=32 << 20)  # a second client (another link)
    other.direct = not direct
    into = [memoryview(bytearray(g.page_bytes)) for _ in range(7)]
    assert other.batch_read_into([k for k, _ in pages] + [key(99)], lambda i: [into[i]]) == 6
    assert [bytes(v) for v in into[:6]] == [p for _, p in pages]
    assert bytes(tier.get(key(3))) == payload(g, 3) and tier.get(key(98)) is None


def test_a_second_write_keeps_the_first_page(mooncake):
    """Mooncake keeps an object that exists (its put is not an upsert): a page key names one
    page's bytes, so the second write is acknowledged and the stored page stays."""
    g = GEOMETRIES["mimo_kv"]
    tier = mooncake(identity(g))
    assert tier.set(key(1), payload(g, 1)) and tier.set(key(1), payload(g, 2))
    assert bytes(tier.get(key(1))) == payload(g, 1)
    assert tier.delete(key(1)) and tier.set(key(1), payload(g, 2))
    assert bytes(tier.get(key(1))) == payload(g, 2)


def flipped(blob: bytes) -> bytes:
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x10
    return bytes(damaged)


# what a hostile or buggy client leaves under one of the tier's keys, and what it counts as
HOSTILE: dict[str, tuple[Callable[[bytes, bytes], bytes], str]] = {
    "flipped payload byte": (lambda page, other: flipped(page), "corrupt"),
    "flipped header byte": (lambda page, other: page[:20] + bytes([page[20] ^ 1]) + page[21:], "corrupt"),
    "truncated": (lambda page, other: page[: len(page) // 2], "corrupt"),
    "one byte longer": (lambda page, other: page + b"\x00", "corrupt"),
    "header only": (lambda page, other: page[: fmt.HEADER_BYTES], "corrupt"),
    "garbage of the page's size": (lambda page, other: b"\xa5" * len(page), "corrupt"),
    "another key's intact page": (lambda page, other: other, "foreign"),
}


@pytest.mark.parametrize("direct", [True, False], ids=["zero-copy", "staged"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_object_under_a_page_key_is_a_miss_removed_and_counted(mooncake, raw, case, direct):
    g = GEOMETRIES["deepseek_mla"]
    tier = mooncake(identity(g))
    tier.direct = direct
    assert tier.batch_set([(key(i), payload(g, i)) for i in range(3)]) == [True] * 3
    page, other = (raw.get(tier.name(k)) for k in (key(1), key(2)))
    make, counter = HOSTILE[case]
    assert raw.upsert(tier.name(key(1)), make(page, other)) == 0
    watched: list[tuple[str, list[bytes]]] = []
    tier.add_watcher(lambda change, keys: watched.append((change, keys)))
    got = tier.batch_get([key(0), key(1), key(2)])
    assert bytes(got[0]) == payload(g, 0) and got[1] is None and bytes(got[2]) == payload(g, 2)
    assert raw.is_exist(tier.name(key(1))) == 0  # removed, though the read leased it
    assert getattr(tier.stats(), counter) == 1 and watched == [("removed", [key(1)])]
    assert tier.set(key(1), payload(g, 1)) and bytes(tier.get(key(1))) == payload(g, 1)  # written again


def test_read_into_stops_at_a_damaged_page(mooncake, raw):
    g = GEOMETRIES["mimo_kv"]
    tier = mooncake(identity(g))
    assert tier.batch_set([(key(i), payload(g, i)) for i in range(3)]) == [True] * 3
    assert raw.upsert(tier.name(key(1)), flipped(raw.get(tier.name(key(1))))) == 0
    into = [memoryview(bytearray(g.page_bytes)) for _ in range(3)]
    assert tier.batch_read_into([key(0), key(1), key(2)], lambda i: [into[i]]) == 1
    assert bytes(into[0]) == payload(g, 0) and tier.stats().corrupt == 1


def test_a_page_of_another_namespace_copied_under_a_key_is_foreign(mooncake, raw):
    g = GEOMETRIES["mimo_fp4"]
    mine, theirs = mooncake(identity(g, "tenant-a")), mooncake(identity(g, "tenant-b"))
    assert theirs.set(key(1), payload(g, 1))
    assert raw.put(mine.name(key(1)), raw.get(theirs.name(key(1)))) == 0
    assert mine.contains(key(1))  # a lookup sees an object; the read refuses it
    assert mine.get(key(1)) is None and mine.stats().foreign == 1 and not mine.contains(key(1))
    assert bytes(theirs.get(key(1))) == payload(g, 1)


def test_stored_and_removed_events(mooncake):
    g = GEOMETRIES["mimo_kv"]
    tier = mooncake(identity(g))
    seen: list[tuple[str, list[bytes]]] = []
    tier.add_watcher(lambda change, keys: seen.append((change, keys)))
    assert tier.batch_set([(key(0), payload(g, 0)), (key(1), payload(g, 1))]) == [True, True]
    assert tier.delete(key(0)) and not tier.delete(key(0))
    assert seen == [("stored", [key(0), key(1)]), ("removed", [key(0)])]


def test_bad_input_raises_and_stores_nothing(mooncake):
    g = GEOMETRIES["mimo_kv"]
    tier = mooncake(identity(g))
    with pytest.raises(ValueError, match=f"must be {g.page_bytes} bytes"):
        tier.batch_set([(key(1), payload(g, 1)), (key(2), b"short")])
    with pytest.raises(ValueError, match="1..64 bytes"):
        tier.batch_set([(key(3), payload(g, 3)), (b"", payload(g, 3))])
    assert tier.batch_contains([key(1), key(2), key(3)]) == [False] * 3
    with pytest.raises(ValueError, match="writable contiguous byte view"):
        tier.batch_read_into([key(1)], lambda i: [memoryview(payload(g, 1))])
    tier.close()
    assert not tier.health().healthy and "closed" in tier.health().detail
    with pytest.raises(ValueError, match="closed"):
        tier.get(key(1))
    with pytest.raises(ValueError, match="closed"):
        tier.delete(key(1))


def test_two_tiers_of_one_process_share_one_client_which_outlives_them(mooncake, master):
    """One Mooncake client (one lent segment) per process and options, however many pools;
    it stays when the last tier closes (its segment holds other sidecars' pages too), and a
    later tier uses it again, until close_links."""
    g = GEOMETRIES["mimo_kv"]
    a = mooncake(identity(g))
    b = mooncake(identity(GEOMETRIES["deepseek_mla"], "other"))
    assert a._link is b._link and a._link.users == 2
    assert a.set(key(1), payload(g, 1))
    a.close()
    b.close()
    link = a._link
    assert link.users == 0 and not link.closed
    c = MooncakeTier(identity(g), master.extra_config())
    assert c._link is link and bytes(c.get(key(1))) == payload(g, 1)  # the segment kept the page
    c.close()
    close_links(master.address)
    assert link.closed and link.ready() is None
    d = MooncakeTier(identity(g), master.extra_config())
    assert d._link is not link and d.health().healthy
    d.close()


@pytest.mark.parametrize("direct", [True, False], ids=["zero-copy", "staged"])
def test_with_a_tier_secret_a_page_planted_without_it_is_a_miss_removed_and_counted(mooncake, raw, direct):
    """#46 point 5: a page in the page format under the victim's identity, with chosen bytes
    and no MAC, was served; Mooncake's put never overwrites, so it would have stayed."""
    g = GEOMETRIES["mimo_kv"]
    tier = mooncake(dataclasses.replace(identity(g), secret=b"the-tier-secret-0123456789"))
    tier.direct = direct
    assert tier.set(key(0), payload(g, 0))
    assert raw.put(tier.name(key(1)), fmt.encode_page(identity(g), key(1), payload(g, 66))) == 0
    got = tier.batch_get([key(0), key(1)])
    assert bytes(got[0]) == payload(g, 0) and got[1] is None
    assert tier.stats().forged == 1 and raw.is_exist(tier.name(key(1))) == 0
