"""The tier secret (#46 point 5): with it, every stored page carries a keyed MAC, and a page
anyone else wrote (no MAC, another secret, changed bytes) is a miss, counted and removed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from tier_helpers import GEOMETRIES, RedisServer, identity, key, payload

from hicache.cache.config import HiCacheConfig, read_tier_secret
from hicache.storage import StorageTier, TierIdentity, make_tier
from hicache.storage import page_format as fmt

SECRET = b"s3cret-of-the-tier-0123456789"
G = GEOMETRIES["mimo_kv"]


def keyed(secret: bytes = SECRET, namespace: str = "") -> TierIdentity:
    return dataclasses.replace(identity(G, namespace), secret=secret)


def test_a_page_round_trips_with_its_mac_and_any_other_page_is_refused() -> None:
    mine, page = keyed(), payload(G, 1)
    blob = fmt.encode_page(mine, key(1), page)
    assert blob[6] == fmt.HMAC_SHA256 and bytes(fmt.decode_page(mine, key(1), blob)) == page
    forged = {
        "no MAC (written without a secret)": fmt.encode_page(identity(G), key(1), page),
        "another secret": fmt.encode_page(keyed(b"another-secret-0123456789"), key(1), page),
        "a payload byte changed": blob[:-1] + bytes([blob[-1] ^ 1]),
        "a header byte changed": blob[:20] + bytes([blob[20] ^ 1]) + blob[21:],
    }
    for case, bad in forged.items():
        with pytest.raises(fmt.PageError, match="forged") as e:
            fmt.decode_page(mine, key(1), bad)
        assert e.value.reason == "forged", case
    with pytest.raises(fmt.PageError) as e:  # a reader without the secret cannot tell: kept for others
        fmt.decode_page(identity(G), key(1), blob)
    assert e.value.reason == "unreadable"
    with pytest.raises(fmt.PageError) as e:  # a valid MAC under another key: it names the key
        fmt.decode_page(mine, key(2), blob)
    assert e.value.reason == "foreign"


def test_the_secret_is_never_shown_and_a_bad_one_is_refused_without_showing_it(tmp_path: Path) -> None:
    assert "s3cret" not in repr(keyed()) and "s3cret" not in repr(HiCacheConfig(tier_secret=SECRET))
    assert keyed() != identity(G)  # one process never shares a tier across secrets
    with pytest.raises(ValueError, match="at least 16 bytes") as e:
        HiCacheConfig(tier_secret=b"short-secret")
    assert "short-secret" not in str(e.value)
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert read_tier_secret("", str(path)) == SECRET and read_tier_secret("abc", "") == b"abc"
    with pytest.raises(ValueError, match="not both"):
        read_tier_secret("x" * 16, str(path))
    with pytest.raises(ValueError, match=r"--hicache-tier-secret-file .*missing: No such file"):
        read_tier_secret("", str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), unix=True)
    server.start()
    yield server.url
    server.stop()


@pytest.mark.parametrize("backend", ["file", "redis", "redis-cluster"])
def test_a_page_planted_in_a_shared_tier_is_a_miss_removed_and_counted(request, tmp_path, backend) -> None:
    """What #46 found: anyone who can write to the tier wrote a page in the page format
    under a victim's identity, with chosen payload bytes, and it was served. With a secret,
    a planted page and an overwritten one are misses; the tier's own pages are served."""
    extra = {
        "file": lambda: {"dir": str(tmp_path)},
        "redis": lambda: {"url": request.getfixturevalue("redis_url")},
        "redis-cluster": lambda: {"url": request.getfixturevalue("redis_cluster").url},
    }[backend]()
    attacker = make_tier(backend, extra, identity(G))  # the same identity, no secret
    assert attacker.set(key(1), payload(G, 66))  # planted before the victim starts (the file scan sees it)
    victim: StorageTier = make_tier(backend, extra, keyed())
    try:
        assert victim.batch_set([(key(0), payload(G, 0)), (key(2), payload(G, 2))]) == [True, True]
        assert attacker.set(key(2), payload(G, 77))  # overwritten where the backend allows it
        assert victim.contains(key(1))  # a lookup sees an object; the read refuses it
        got = victim.batch_get([key(0), key(1), key(2)])
        assert bytes(got[0]) == payload(G, 0) and got[1] is None and got[2] is None
        assert victim.stats().forged == 2 and victim.stats().hits == 1
        assert not victim.contains(key(1)) and not victim.contains(key(2))  # removed
        assert victim.set(key(1), payload(G, 1)) and bytes(victim.get(key(1))) == payload(G, 1)
        assert attacker.get(key(1)) is None and attacker.stats().last_error  # unreadable for it, left in place
        assert victim.get(key(1)) is not None
        victim.check_integrity()
    finally:
        victim.close()
        attacker.close()
        if backend == "redis":
            RedisServer.flush(extra["url"])
        if backend == "redis-cluster":
            request.getfixturevalue("redis_cluster").flush()
