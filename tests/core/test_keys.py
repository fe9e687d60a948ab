import pytest

from hicache.keys import KEY_BYTES, available_hashes, page_keys


def test_one_key_per_full_page_and_chaining():
    keys = page_keys(list(range(10)), 4)
    assert len(keys) == 2 and all(len(key) == 32 for key in keys)
    assert page_keys(list(range(4, 8)), 4, parent=keys[0]) == [keys[1]]
    assert page_keys(list(range(8)), 4) == keys
    assert page_keys([], 4) == []


def test_key_depends_on_prefix_namespace_and_tokens():
    a = page_keys([1, 2, 3, 4, 5, 6], 3)
    b = page_keys([9, 2, 3, 4, 5, 6], 3)
    assert a[1] != b[1]  # same second page, different prefix
    assert page_keys([1, 2, 3], 3, namespace="tenant-a") != page_keys([1, 2, 3], 3, namespace="tenant-b")
    assert page_keys([1, 2, 3], 3, namespace="") != page_keys([1, 2, 3], 3, namespace="x")


@pytest.mark.parametrize("name", available_hashes())
def test_hashes(name):
    keys = page_keys([1, 2, 3, 4], 2, hash_name=name)
    assert [len(key) for key in keys] == [KEY_BYTES[name]] * 2


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"page_size": 0}, "page_size must be an int >= 1, got 0"),
        ({"namespace": b"x"}, "namespace must be a str, got bytes"),
        ({"parent": b"short"}, "parent must be a 32-byte sha256 key"),
        ({"hash_name": "md5"}, "unknown key hash 'md5'"),
    ],
)
def test_key_errors(kwargs, message):
    args = {"token_ids": [1, 2], "page_size": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        page_keys(**args)


def test_negative_tokens_rejected():
    with pytest.raises(ValueError, match="non-negative ints"):
        page_keys([1, -2], 2)
