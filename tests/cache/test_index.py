import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache import HostIndex


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def fill(index: HostIndex, keys: list[bytes]) -> list[int]:
    got = index.allocate(len(keys))
    assert got is not None
    pages, _ = got
    for key, page in zip(keys, pages, strict=True):
        index.bind(key, page)
    index.check_integrity()
    return pages


def test_allocate_bind_lookup():
    index = HostIndex(4)
    pages = fill(index, [k(1), k(2)])
    assert index.page_of(k(1)) == pages[0] and index.page_of(k(2)) == pages[1]
    assert index.free_pages == 2 and len(index) == 2 and k(1) in index
    assert index.prefix_length([k(1), k(2), k(3), k(1)]) == 2


def test_lru_eviction_order_and_touch():
    index = HostIndex(3)
    fill(index, [k(1), k(2), k(3)])
    index.touch(k(1))  # order now 2, 3, 1
    got = index.allocate(2)
    assert got is not None
    pages, evicted = got
    assert [key for key, _ in evicted] == [k(2), k(3)]
    assert sorted(pages) == sorted(p for _, p in evicted)
    assert k(1) in index and k(2) not in index
    index.check_integrity()


def test_pins_and_refs_protect_from_eviction():
    index = HostIndex(3)
    fill(index, [k(1), k(2), k(3)])
    index.pin(k(1))
    index.ref(k(2))
    assert index.allocate(2) is None  # only k(3) is evictable: nothing changes
    assert len(index) == 3
    index.check_integrity()
    got = index.allocate(1)
    assert got is not None and got[1] == [(k(3), got[0][0])]
    with pytest.raises(ValueError, match="is pinned"):
        index.remove(k(1))
    index.unpin(k(1))
    index.unref(k(2))
    assert [key for key, _ in index.evict(5)] == [k(1), k(2)]  # unpin made k(1) evictable first
    index.check_integrity()


def test_release_and_errors():
    index = HostIndex(2)
    got = index.allocate(2)
    assert got is not None
    index.release([got[0][0]])
    index.check_integrity()
    with pytest.raises(ValueError, match="page 0 is not reserved|page 1 is not reserved"):
        index.release([got[0][0]])
    with pytest.raises(ValueError, match="page 7 is not reserved"):
        index.bind(k(1), 7)
    index.bind(k(1), got[0][1])
    with pytest.raises(ValueError, match="already resident"):
        index.bind(k(1), got[0][1])
    with pytest.raises(KeyError, match="is not resident"):
        index.pin(k(9))
    with pytest.raises(ValueError, match="is not pinned"):
        index.unpin(k(1))
    with pytest.raises(ValueError, match="is not referenced"):
        index.unref(k(1))
    with pytest.raises(ValueError, match="num_pages must be an int >= 1, got 0"):
        HostIndex(0)
    with pytest.raises(ValueError, match="page count must be an int >= 0, got -1"):
        index.allocate(-1)
    index.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "remove", "pin", "unpin", "ref", "unref", "touch", "evict"]), st.integers(0, 9)
        ),
        max_size=60,
    )
)
def test_random_operations_keep_integrity(ops):
    index = HostIndex(5)
    for op, i in ops:
        try:
            if op == "alloc":
                got = index.allocate(1)
                if got is not None and k(i) not in index:
                    index.bind(k(i), got[0][0])
                elif got is not None:
                    index.release(got[0])
            elif op == "evict":
                index.evict(i % 3)
            else:
                getattr(index, op)(k(i))
        except (KeyError, ValueError):
            pass
        index.check_integrity()


def test_release_of_a_page_listed_twice_changes_nothing():
    index = HostIndex(4)
    got = index.allocate(3)
    assert got is not None
    pages = got[0]
    with pytest.raises(ValueError, match=f"page {pages[0]} is listed twice"):
        index.release([pages[0], pages[1], pages[0], pages[2]])
    assert index.free_pages == 1  # nothing released
    index.release(pages)
    assert index.free_pages == 4
    index.check_integrity()


def test_allocate_never_evicts_a_kept_key():
    index = HostIndex(3)
    fill(index, [k(1), k(2), k(3)])  # LRU: 1, 2, 3
    assert index.room([k(1), k(9)]) == 2
    assert index.allocate(3, keep=[k(1)]) is None
    got = index.allocate(2, keep=[k(1)])
    assert got is not None and [key for key, _ in got[1]] == [k(2), k(3)]
    assert k(1) in index
    index.check_integrity()


def test_a_key_dropped_above_a_shrunken_limit_is_reported():
    index = HostIndex(4)
    dropped: list[bytes] = []
    index.on_drop = dropped.append
    fill(index, [k(0), k(1), k(2), k(3)])
    index.pin(k(3))  # page 3
    index.resize(2)
    assert k(3) in index and dropped == []
    index.unpin(k(3))  # released above the line: dropped, and its owner told so
    assert k(3) not in index and dropped == [k(3)]
    index.check_integrity()


def test_a_key_bound_above_the_limit_after_a_shrink_goes_at_the_next_resize():
    index = HostIndex(4)
    got = index.allocate(4)
    assert got is not None
    index.resize(2)  # pages 2 and 3 are reserved: copies in flight
    index.bind(k(1), 3)
    index.release([0, 1, 2])
    index.take_retired()
    assert index.resize(2) == [(k(1), 3)]  # idle above the line: evicted, its page retired
    assert k(1) not in index and index.take_retired() == [3]
    index.check_integrity()
