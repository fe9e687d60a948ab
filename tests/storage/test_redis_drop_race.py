"""A bad value the Redis tier reads under a page key (damaged, another size, another type)
is deleted only while the key still holds it: a page another sidecar stores between the
read and the delete is kept. On one server and on a cluster, where the conditional delete
(a script) goes to the node of the key's slot."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from tier_helpers import GEOMETRIES, identity, key, payload

from hicache.storage.redis import RedisTier

G = GEOMETRIES["mimo_kv"]

# (how the value is spoiled, how the tier reads it): each of the delete script's three checks
CASES = [
    ("flipped byte", "get"),
    ("flipped byte", "batch_read"),
    ("wrong size", "get"),
    ("wrong size", "contains"),
    ("wrong type", "get"),
    ("wrong type", "contains"),
]


@pytest.fixture(params=["server", "cluster"])
def tier_and_raw(request: pytest.FixtureRequest) -> Iterator[tuple[RedisTier, Any]]:
    """A tier, and a plain redis-py client of the same server or cluster."""
    if request.param == "server":
        server = request.getfixturevalue("redis_server")
        tier, raw = RedisTier(identity(G), server.url), server.client()
    else:
        cluster = request.getfixturevalue("redis_cluster")
        tier, raw = RedisTier(identity(G), cluster.url, cluster=True), redis.RedisCluster.from_url(cluster.url)
    yield tier, raw
    tier.close()
    raw.flushall()
    raw.close()


def spoil(raw: Any, name: bytes, how: str) -> bytes:
    """Replace the page stored under `name` by a bad value; returns the good one."""
    good: bytes = raw.get(name)
    if how == "flipped byte":
        value = bytearray(good)
        value[len(value) // 2] ^= 0x10
        raw.set(name, bytes(value))
    elif how == "wrong size":
        raw.set(name, good[:-1])
    else:
        raw.delete(name)
        raw.rpush(name, b"not a page")
    return good


def read(tier: RedisTier, page: bytes, how: str) -> bool:
    """Whether the tier finds the page, read the way `how` says."""
    if how == "contains":
        return tier.contains(page)
    if how == "batch_read":  # into the thread's reused buffer, which the delete then sends
        return tier.batch_read([page], lambda i, data: None) == 1
    return tier.get(page) is not None


def removals(tier: RedisTier) -> list[bytes]:
    """The page keys the tier will report removed (its KV events)."""
    removed: list[bytes] = []
    tier.add_watcher(lambda change, keys: removed.extend(keys) if change == "removed" else None)
    return removed


@pytest.mark.parametrize(("damage", "how"), CASES)
def test_a_bad_value_under_a_page_key_is_deleted(tier_and_raw, damage, how):
    tier, raw = tier_and_raw
    assert tier.set(key(1), payload(G, 1))
    spoil(raw, tier.qualified(key(1)), damage)
    removed = removals(tier)
    assert not read(tier, key(1), how)
    assert raw.exists(tier.qualified(key(1))) == 0 and removed == [key(1)]
    assert tier.stats().corrupt == 1


@pytest.mark.parametrize(("damage", "how"), CASES)
def test_a_page_stored_between_the_read_and_the_delete_is_kept(tier_and_raw, damage, how, monkeypatch):
    tier, raw = tier_and_raw
    assert tier.set(key(1), payload(G, 1))
    name = tier.qualified(key(1))
    good = spoil(raw, name, damage)
    link, calls = tier._link, []
    run = link.run

    def another_sidecar_stores_before_the_second_call(commands: Any, into: Any = None) -> list[Any]:
        calls.append(commands)
        if len(calls) == 2:  # the first read; then, before the delete, a fresh SET
            raw.set(name, good)
        return run(commands, into)

    monkeypatch.setattr(link, "run", another_sidecar_stores_before_the_second_call)
    removed = removals(tier)
    assert not read(tier, key(1), how)  # what it read was bad
    assert len(calls) == 2 and raw.get(name) == good and removed == []  # the fresh page is kept
    monkeypatch.undo()
    assert read(tier, key(1), "get") and bytes(tier.get(key(1))) == payload(G, 1)
