"""Storage and server edge cases: error replies, unreadable pages, odd batches, bad options,
socket paths, shared-memory names."""

import math
import os
import socket
import threading
from pathlib import Path

import pytest
import redis
from tier_helpers import GEOMETRIES, RedisServer, identity, key, payload

from hicache.cache.config import HiCacheConfig
from hicache.memory import RefCountedOpens
from hicache.storage import page_format
from hicache.storage.file import FileTier
from hicache.storage.redis import RedisTier
from server.app import _prepare_socket

G = GEOMETRIES["mimo_kv"]


def test_a_redis_error_reply_fails_its_pages_but_not_the_tier(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    try:
        tier = RedisTier(identity(G), server.url, timeout_s=5.0, backoff_initial_s=5.0, backoff_max_s=10.0)
        assert tier.set(key(0), payload(G, 0))
        client = redis.Redis.from_url(server.url)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 200_000)
        client.config_set("maxmemory-policy", "noeviction")
        results = tier.batch_set([(key(i), payload(G, i)) for i in range(1, 33)])  # 640 KB: some fit
        stored = [bool(client.exists(tier.qualified(key(i)))) for i in range(1, 33)]
        assert results == stored and not all(stored)  # each page answered for itself
        assert tier.health().healthy  # an error reply is not an outage: no backoff
        assert tier.get(key(0)) is not None  # reads still go to the server
    finally:
        server.stop()


def test_a_page_checksummed_with_a_missing_algorithm_is_a_miss_not_deleted(tmp_path, monkeypatch):
    tier = FileTier(identity(G), tmp_path)
    assert (
        tier.set(
            key(1),
            payload(G, 1),
        )
        and page_format.default_algorithm() == page_format.XXH3_64
    )
    monkeypatch.setattr(page_format, "_checksummer", lambda algorithm, secret=b"": None)  # as without xxhash
    assert tier.get(key(1)) is None
    assert tier.path_of(key(1)).exists() and tier.contains(key(1))  # kept for sidecars that can read it
    monkeypatch.undo()
    assert bytes(tier.get(key(1))) == payload(G, 1)


def test_a_file_tier_batch_with_one_key_twice_keeps_the_last(tmp_path):
    tier = FileTier(identity(G), tmp_path)
    assert tier.batch_set([(key(2), payload(G, 1)), (key(2), payload(G, 2))]) == [True, True]
    assert bytes(tier.get(key(2))) == payload(G, 2)
    assert not list(tmp_path.rglob("*.tmp"))
    tier.check_integrity()


def test_a_file_that_cannot_be_removed_does_not_raise(tmp_path, monkeypatch):
    tier = FileTier(identity(G), tmp_path, max_bytes=2 * page_format.stored_size(identity(G), key(0)))
    assert tier.batch_set([(key(0), payload(G, 0)), (key(1), payload(G, 1))]) == [True, True]

    def refuse(path):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "unlink", refuse)
    assert tier.set(key(2), payload(G, 2))  # evicting key 0 fails to unlink: logged, not raised
    assert tier.delete(key(1)) is True  # gone from the index even if the file stays
    assert tier.contains(key(2)) and not tier.contains(key(0)) and not tier.contains(key(1))


@pytest.mark.parametrize(
    "backend,extra,message",
    [
        ("file", {"max_bytes": -1}, "max_bytes must be an int >= 1"),
        ("file", {"fsync": "yes"}, '"fsync" must be true, false or "batch"'),
        ("file", {"dir": "/etc/passwd"}, "exists and is not a folder"),
        ("redis", {"url": "redis://x", "backoff_max_s": "10"}, "backoff_max_s must be a finite number"),
        ("redis", {"url": "redis://x", "timeout_s": True}, "timeout_s must be a finite number"),
        ("redis", {"url": "redis://x", "ttl_s": math.nan}, "ttl_s must be a finite number"),
        ("redis", {"url": "http://x"}, "redis url must start with"),
    ],
)
def test_bad_tier_options_are_refused_at_start_up(backend, extra, message):
    with pytest.raises(ValueError, match=message):
        HiCacheConfig(storage_backend=backend, extra_config=extra)


def test_the_socket_path_must_be_a_socket_in_a_safe_folder(tmp_path):
    victim = tmp_path / "config.json"
    victim.write_text("{}")
    with pytest.raises(ValueError, match="exists and is not a socket"):
        _prepare_socket(str(victim))
    assert victim.exists()
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # nobody listens: a stale socket, removed
    _prepare_socket(str(stale))
    assert not stale.exists()
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ValueError, match="writable by others"):
        _prepare_socket(str(open_dir / "hc.sock"))
    if os.getuid() == 0:  # someone else's folder (needs root to make one)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ValueError, match="belongs to uid 65534"):
            _prepare_socket(str(theirs / "hc.sock"))


def test_refcounted_opens_close_before_a_new_open():
    live: list[str] = []
    closing = threading.Event()
    proceed = threading.Event()

    def open_fn(k: str) -> str:
        assert k not in live, "opened twice while still open"
        live.append(k)
        return k

    def close_fn(k: str) -> None:
        closing.set()
        assert proceed.wait(30)
        live.remove(k)

    opens: RefCountedOpens[str, str] = RefCountedOpens(open_fn, close_fn)
    opens.acquire("h")
    closer = threading.Thread(target=opens.release, args=("h",))
    closer.start()
    assert closing.wait(30)
    got: list[str] = []
    opener = threading.Thread(target=lambda: got.append(opens.acquire("h")))
    opener.start()
    opener.join(0.1)
    assert opener.is_alive()  # waits for the close to finish
    proceed.set()
    closer.join(30)
    opener.join(30)
    assert got == ["h"] and live == ["h"]


def test_open_shm_refuses_a_symlink(tmp_path):
    from hicache.memory import create_shm, open_shm, shm_dir

    seg = create_shm(4096)
    link = f"hicache-link-{os.getpid()}"
    path = Path(shm_dir()) / link
    os.symlink(Path(shm_dir()) / seg.handle.name, path)
    try:
        with pytest.raises(ValueError, match="cannot be opened as a plain file"):
            open_shm(link, 4096)
    finally:
        path.unlink()
        seg.close()


def test_pools_of_one_identity_share_one_file_tier(tmp_path):
    from hicache.storage import make_tier

    extra = {"dir": str(tmp_path), "max_bytes": 1 << 20}
    first = make_tier("file", extra, identity(G))
    assert make_tier("file", extra, identity(G)) is first  # one index and one cap for the folder
    assert make_tier("file", extra, identity(G, namespace="other")) is not first
    assert first.set(key(3), payload(G, 3))
    again = make_tier("file", {"dir": str(tmp_path / "."), "max_bytes": 1 << 20}, identity(G))
    assert again is first and again.contains(key(3))
