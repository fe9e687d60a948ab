"""Files in the file tier's folder that are not pages: a page file replaced by a huge sparse
file, a FIFO or a symlink. Each is a corrupt page (deleted, counted, a miss): the tier
never allocates what a file's size claims, never blocks on a FIFO, never follows a link,
and a Reload still serves the prefix before it."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_util import filled_device, keys_for, start_sidecar, wait_stored
from tier_helpers import GEOMETRIES, identity, key, payload

from hicache.api import KeyStatus as S
from hicache.api import Tier
from hicache.client import HiCacheClient
from hicache.storage.file import FileTier

G = GEOMETRIES["mimo_kv"]
TIB = 1 << 40


def tamper(path: Path, how: str, tmp: Path) -> None:
    """Put something that is not a page where the page file `path` was."""
    path.unlink()
    if how == "sparse_1tib":
        with open(path, "wb") as f:
            f.truncate(TIB)
    elif how == "fifo":
        os.mkfifo(path)
    else:  # a symlink to a valid-looking file of the right size
        target = tmp / "elsewhere.page"
        target.write_bytes(b"\0" * 64)
        os.symlink(target, path)


@pytest.mark.parametrize("how", ["sparse_1tib", "fifo", "symlink"])
def test_a_page_file_that_is_not_a_page_is_a_counted_deleted_miss(tmp_path: Path, how: str) -> None:
    tier = FileTier(identity(G), tmp_path / "tier")
    assert tier.batch_set([(key(i), payload(G, i)) for i in range(3)]) == [True] * 3
    tamper(tier.path_of(key(1)), how, tmp_path)
    started = time.monotonic()
    assert tier.get(key(1)) is None  # no MemoryError, no hang
    assert time.monotonic() - started < 30
    assert not os.path.lexists(tier.path_of(key(1))) and not tier.contains(key(1))
    stats = tier.stats()
    assert stats.corrupt == 1 and stats.misses == 1
    assert bytes(tier.get(key(2))) == payload(G, 2)  # the rest of the tier is untouched
    tier.check_integrity()


@pytest.mark.parametrize("how", ["fifo", "symlink"])
def test_the_start_up_scan_drops_non_files(tmp_path: Path, how: str) -> None:
    tier = FileTier(identity(G), tmp_path / "tier")
    assert tier.batch_set([(key(i), payload(G, i)) for i in range(2)]) == [True, True]
    tamper(tier.path_of(key(0)), how, tmp_path)
    again = FileTier(identity(G), tmp_path / "tier")
    assert not again.contains(key(0)) and again.contains(key(1))
    assert not os.path.lexists(again.path_of(key(0))) and again.stats().corrupt == 1


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("how", ["sparse_1tib", "fifo"])
def test_reload_serves_the_prefix_before_a_hostile_file_and_sigterm_still_stops(sockdir: str, how: str) -> None:
    proc, address = start_sidecar(sockdir)
    dev = filled_device(8, seed=3)
    client = HiCacheClient(address, timeout=60)
    try:
        client.register(dev, model_id="MiMo-V2-Flash@main")
        keys = keys_for(4, seed=7)
        want = [dev.read_page(p).clone() for p in range(4)]
        assert client.offload(keys, range(4)).statuses == (S.STORED,) * 4
        wait_stored(client, 4, tries=3000)
        client.evict(keys[2:])  # pages 2 and 3 now live in the file tier only
        assert client.lookup(keys).tiers == (Tier.HOST, Tier.HOST, Tier.STORAGE, Tier.STORAGE)
        (page_file,) = Path(sockdir, "tier").rglob(keys[2].hex() + ".page")
        tamper(page_file, how, Path(sockdir))
        started = time.monotonic()
        got = client.reload(keys, [4, 5, 6, 7]).statuses
        assert time.monotonic() - started < 15
        assert got == (S.LOADED, S.LOADED, S.NOT_FOUND, S.NOT_FOUND)
        assert [dev.read_page(p).equal(w) for p, w in zip((4, 5), want, strict=False)] == [True, True]
        assert not os.path.lexists(page_file)
        assert client.lookup(keys).tiers[2] == Tier.NONE  # Lookup and Reload agree now
        assert client.stats()[0].tiers[1].misses >= 1
    finally:
        client.close()
        dev.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # the server's grace period is well under this
    assert proc.returncode is not None


@pytest.mark.parametrize("value", ["list", "short_string", "hash"])
def test_a_redis_value_that_is_not_a_page_makes_lookup_and_get_agree(tmp_path: Path, value: str) -> None:
    import redis
    from tier_helpers import RedisServer

    from hicache.storage.redis import RedisTier

    server = RedisServer(tmp_path)
    server.start()
    try:
        tier = RedisTier(identity(G), server.url)
        assert tier.batch_set([(key(i), payload(G, i)) for i in range(3)]) == [True] * 3
        raw = redis.Redis.from_url(server.url)
        q = tier.qualified(key(1))
        raw.delete(q)
        if value == "list":
            raw.rpush(q, b"a", b"b")
        elif value == "hash":
            raw.hset(q, "f", "v")
        else:
            raw.set(q, b"not a page")
        assert tier.batch_contains([key(0), key(1), key(2)]) == [True, False, True]  # never "present"
        assert not raw.exists(q)  # ours to delete: it was under our page key
        assert tier.stats().corrupt == 1
        raw.rpush(q, b"again")  # and get() answers the same way
        assert tier.get(key(1)) is None and not raw.exists(q)
        assert tier.stats().corrupt == 2
        assert bytes(tier.get(key(2))) == payload(G, 2)
    finally:
        server.stop()
