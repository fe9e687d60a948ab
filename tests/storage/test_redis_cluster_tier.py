"""The Redis tier over a real Redis Cluster (3 masters, 3 replicas on loopback ports):
pages spread over the masters, a master killed mid-run, slots resharded under load, and
the start-up errors for a config that disagrees with the server about being a cluster."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import eventually, held_by_another_thread, in_forked_child
from tier_helpers import GEOMETRIES, RedisServer, identity, key, payload

from hicache.demo.redis_cluster import LocalRedisCluster, _ephemeral_low, free_ports
from hicache.storage import make_tier
from hicache.storage.factory import backend_reachable, check_backend_kind
from hicache.storage.redis import RedisTier

G = GEOMETRIES["mimo_kv"]


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalRedisCluster]:
    """A cluster of this test's own, for tests that reshard."""
    with LocalRedisCluster(tmp_path / "cluster") as cluster:
        yield cluster


@pytest.fixture
def failover_cluster(tmp_path: Path) -> Iterator[LocalRedisCluster]:
    """A cluster of this test's own whose replicas take over 1.5 s after their master stops
    answering (the default 5 s keeps a node starved of CPU from being failed over)."""
    with LocalRedisCluster(tmp_path / "cluster", node_timeout_ms=1500) as cluster:
        yield cluster


def fast_tier(url: str | list[str]) -> RedisTier:
    """Quick to retry; the 5 s timeout is for a busy machine (a killed node refuses at once)."""
    tier = make_tier(
        "redis-cluster", {"url": url, "timeout_s": 5.0, "backoff_initial_s": 0.05, "backoff_max_s": 0.5}, identity(G)
    )
    assert isinstance(tier, RedisTier)
    return tier


def test_pages_spread_over_every_master(redis_cluster: LocalRedisCluster) -> None:
    tier = fast_tier(redis_cluster.url)
    pages = [(key(i), payload(G, i)) for i in range(300)]
    assert tier.batch_set(pages) == [True] * 300
    counts = []
    for port in redis_cluster.master_ports():
        with redis.Redis(port=port) as node:
            counts.append(node.dbsize())
    assert sum(counts) == 300 and min(counts) > 60, counts  # no hash tag piles a model onto one slot
    got = tier.batch_get([k for k, _ in pages])
    assert [bytes(g) if g is not None else None for g in got] == [p for _, p in pages]
    read: dict[int, bytes] = {}  # the masters answer in parallel, into one buffer of the caller's
    assert tier.batch_read([k for k, _ in pages], lambda i, data: read.__setitem__(i, bytes(data))) == 300
    assert [read[i] for i in range(300)] == [p for _, p in pages]
    assert tier.stats().nodes_down == [] and tier.health().healthy
    link = tier._link
    client = link._cluster()  # a call in flight across close() holds the client it started with
    node = client.nodes_manager.get_node_from_slot(0)
    tier.close()
    closed = f"redis cluster {link.url} closed"
    assert link.run([("GET", tier.qualified(key(0)))])[0].args == (closed,)
    assert link._client is None  # a call after close() makes no new client (nothing would close it)
    assert [r.args for r in link._pipeline(client, node, [("GET", b"k")], False)] == [(closed,)]
    assert link._node_wires == {} and link.health().detail == closed  # and no new connections
    redis_cluster.flush()


def test_a_list_of_startup_nodes_and_a_dead_first_one(redis_cluster: LocalRedisCluster) -> None:
    tier = fast_tier(["redis://127.0.0.1:1", *redis_cluster.urls[1:3]])  # nothing listens on port 1
    assert tier.set(key(1), payload(G, 1)) and bytes(tier.get(key(1))) == payload(G, 1)
    tier.close()
    redis_cluster.flush()


class Load:
    """A thread writing pages and reading back random earlier ones through `tier`: every
    page served must be the one written; no call may raise."""

    def __init__(self, tier: RedisTier):
        self.tier = tier
        self.written: dict[bytes, bytes] = {}
        self.hits = self.misses = self.wrong = self.failed_writes = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.n = 0

    def _run(self) -> None:
        rng = random.Random(7)
        try:
            while not self._stop.is_set():
                batch = [(key(self.n + i), payload(G, self.n + i)) for i in range(8)]
                for (k, p), ok in zip(batch, self.tier.batch_set(batch), strict=True):
                    if ok:
                        self.written[k] = p
                    else:
                        self.failed_writes += 1
                self.n += 8
                keys = rng.sample(sorted(self.written), min(16, len(self.written)))
                for k, got in zip(keys, self._read(keys), strict=True):
                    if got is None:
                        self.misses += 1
                    elif bytes(got) == self.written[k]:
                        self.hits += 1
                    else:
                        self.wrong += 1
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.errors.append(exc)

    def _read(self, keys: list[bytes]) -> list[bytes | memoryview | None]:
        """batch_get and batch_read (replies received into one buffer, across redirects) in turn;
        batch_read's keys after its first miss count as misses."""
        if self.n % 16:
            return self.tier.batch_get(keys)
        read: dict[int, bytes] = {}
        self.tier.batch_read(keys, lambda i, data: read.__setitem__(i, bytes(data)))
        return [read.get(i) for i in range(len(keys))]

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def snapshot(self) -> tuple[int, int]:
        return self.hits, self.misses


def test_a_master_killed_mid_run_fails_over_to_its_replica(failover_cluster: LocalRedisCluster) -> None:
    own_cluster = failover_cluster
    tier = fast_tier(own_cluster.url)
    with Load(tier) as load:
        eventually(lambda: load.hits > 50)
        victim = own_cluster.master_ports()[1]
        own_cluster.kill(victim)
        eventually(lambda: not tier.health().healthy or f"127.0.0.1:{victim}" in tier.nodes_down())
        own_cluster.wait_ok()  # the replica has taken over
        eventually(lambda: tier.health().healthy)
        hits_after = load.hits
        eventually(lambda: load.hits > hits_after + 100)  # hits again after the failover
    assert not load.errors, load.errors
    assert load.wrong == 0, "a wrong page was served"
    assert load.misses > 0 or load.failed_writes > 0, "the failover cost nothing: was the master killed?"
    stats = tier.stats()
    assert stats.healthy and stats.nodes_down == [f"127.0.0.1:{victim}"], stats.nodes_down
    assert "served" in tier.health().detail  # healthy, and it says which node is down
    # every page written after the failover is readable
    fresh = [(key(10**6 + i), payload(G, i)) for i in range(50)]
    assert tier.batch_set(fresh) == [True] * 50
    assert [bytes(g) if g is not None else None for g in tier.batch_get([k for k, _ in fresh])] == [p for _, p in fresh]
    tier.close()


def test_resharding_under_load_serves_only_verified_pages(own_cluster: LocalRedisCluster) -> None:
    tier = fast_tier(own_cluster.url)
    with Load(tier) as load:
        eventually(lambda: len(load.written) > 400)
        masters = own_cluster.master_ports()
        own_cluster.reshard(masters[0], masters[1], 1500)
        own_cluster.reshard(masters[2], masters[0], 500)
        n_after = load.n
        eventually(lambda: load.n > n_after + 200)
    assert not load.errors, load.errors
    assert load.wrong == 0 and load.failed_writes == 0, (load.wrong, load.failed_writes)
    written = dict(load.written)
    got = tier.batch_get(list(written))
    assert [bytes(g) if g is not None else None for g in got] == list(written.values()), "a page was lost"
    assert tier.health().healthy
    tier.close()


def test_unreachable_cluster_at_start_does_not_raise() -> None:
    tier = fast_tier("redis://127.0.0.1:1")
    assert tier.get(key(0)) is None and tier.set(key(0), payload(G, 0)) is False
    health = tier.health()
    assert not health.healthy and "unreachable" in health.detail
    assert tier.stats().nodes_down == ["redis://127.0.0.1:1"]
    ok, why = backend_reachable("redis-cluster", {"url": "redis://127.0.0.1:1", "timeout_s": 0.2})
    assert not ok and "unreachable" in why
    tier.close()


def test_cluster_and_plain_server_mismatches_are_start_up_errors(
    redis_cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    plain = RedisServer(tmp_path)
    plain.start()
    try:
        with pytest.raises(ValueError, match=r"is not a cluster node \(cluster_enabled:0\)"):
            check_backend_kind("redis-cluster", {"url": plain.url.removesuffix("/0")})
        with pytest.raises(ValueError, match=r"is a Redis Cluster node .* redis-cluster"):
            check_backend_kind("redis", {"url": redis_cluster.url})
        with pytest.raises(ValueError, match=r"is a Redis Cluster node"):
            check_backend_kind("redis", {"url": redis_cluster.url, "cluster": False})
        check_backend_kind("redis", {"url": redis_cluster.url, "cluster": True})
        check_backend_kind("redis", {"url": plain.url})
        check_backend_kind("redis-cluster", {"url": "redis://127.0.0.1:1", "timeout_s": 0.2})  # unreachable passes
        ok, why = backend_reachable("redis", {"url": redis_cluster.url})
        assert not ok and "redis-cluster" in why
    finally:
        plain.stop()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("unix:///tmp/x.sock", "no unix sockets"),
        ("redis://127.0.0.1:7000/3", "no database but 0"),
        (["redis://127.0.0.1:7000", 5], "a URL or a list of URLs"),
        ([], 'needs "url"'),
        ("redis://", "needs host:port"),
    ],
)
def test_bad_cluster_urls_are_refused_naming_them(url: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_tier("redis-cluster", {"url": url}, identity(G))


def test_cluster_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="cluster must be true or false, got 'yes'"):
        make_tier("redis", {"url": "redis://127.0.0.1:7000", "cluster": "yes"}, identity(G))


def test_a_batch_waits_for_every_node_when_one_fails_at_once(
    redis_cluster: LocalRedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replies land in the caller's buffers: a call that returned while a slower node was
    still receiving would let the caller reuse them under it."""
    from redis.crc import key_slot

    tier = fast_tier(redis_cluster.url)
    pages = [(key(i), payload(G, i)) for i in range(60)]
    assert tier.batch_set(pages) == [True] * 60
    link: Any = tier._link
    failing = link._cluster().nodes_manager.get_node_from_slot(key_slot(tier.qualified(pages[0][0]))).name
    real = link._pipeline

    def pipeline(client: Any, node: Any, commands: list[Any], asking: bool, into: Any = None) -> list[Any]:
        if node.name == failing:  # answers at once: "down"
            return [redis.ConnectionError("refused")] * len(commands)
        time.sleep(0.3)  # the others take a while
        return real(client, node, commands, asking, into)

    monkeypatch.setattr(link, "_pipeline", pipeline)
    read: dict[int, bytes] = {}
    got = tier.batch_get([k for k, _ in pages])
    tier.batch_read([k for k, _ in pages[1:]], lambda i, data: read.__setitem__(i, bytes(data)))
    monkeypatch.undo()
    manager = link._cluster().nodes_manager
    slots = [manager.get_node_from_slot(key_slot(tier.qualified(k))).name for k, _ in pages]
    healthy = [i for i, name in enumerate(slots) if name != failing]
    assert healthy and all(got[i] is not None and bytes(got[i]) == pages[i][1] for i in healthy)
    assert all(got[i] is None for i in range(60) if slots[i] == failing)
    first_miss = next(i for i in range(1, 60) if slots[i] == failing) - 1
    assert [read[i] for i in range(first_miss)] == [p for _, p in pages[1 : 1 + first_miss]]
    tier.close()
    redis_cluster.flush()


def test_a_forked_child_reads_a_batch_that_spans_every_master(redis_cluster: LocalRedisCluster) -> None:
    """The batch runs on one thread per master: the child must make its own (the parent's
    are not copied by fork), its own connections, and its own locks (a parent thread held one
    at the fork)."""
    tier = fast_tier(redis_cluster.url)
    pages = [(key(i), payload(G, i)) for i in range(60)]
    assert tier.batch_set(pages) == [True] * 60  # the parent's threads and connections exist
    link: Any = tier._link

    def child() -> bool:
        got = tier.batch_get([k for k, _ in pages])
        return [bytes(g) if g is not None else None for g in got] == [p for _, p in pages]

    with held_by_another_thread(link._lock):
        assert in_forked_child(child, timeout=60)
    got = tier.batch_get([k for k, _ in pages])
    assert [bytes(g) if g is not None else None for g in got] == [p for _, p in pages]  # the parent's still work
    tier.close()
    redis_cluster.flush()


def test_a_redirect_without_a_host_goes_to_the_host_that_sent_it(tmp_path: Path) -> None:
    """A node whose endpoint is unknown (cluster-preferred-endpoint-type unknown-endpoint)
    redirects with a port only ("MOVED 3999 :7001"): the tier follows it to the host it sent
    the command to, and no phantom node ":7001" is reported down."""
    from redis.crc import key_slot

    with LocalRedisCluster(tmp_path / "cluster", masters=3, replicas=0) as cluster:
        for port in cluster.master_ports():
            with redis.Redis(port=port) as node:
                node.config_set("cluster-preferred-endpoint-type", "unknown-endpoint")
        tier = fast_tier(cluster.urls)
        assert tier.set(key(1), payload(G, 1))
        link: Any = tier._link
        manager = link._cluster().nodes_manager
        slot = key_slot(tier.qualified(key(1)))
        owner = manager.slots_cache[slot][0]
        other = next(n for n in manager.nodes_cache.values() if n.name != owner.name)
        manager.slots_cache[slot] = [other]  # a stale slot map, as after a resharding
        with redis.Redis(port=other.port) as node, pytest.raises(redis.ResponseError, match=r"^\d+ :\d+$"):
            node.get(tier.qualified(key(1)))  # the redirect names no host
        got = tier.get(key(1))
        assert got is not None and bytes(got) == payload(G, 1)
        assert tier.nodes_down() == [] and not [name for name in link._nodes if name.startswith(":")]
        tier.close()


def test_the_local_cluster_starts_when_a_port_is_taken_after_it_was_picked(tmp_path: Path) -> None:
    """Another process binds a node's port between free_ports() and redis-server's bind (a CI
    run failed so once): the node moves to new ports and the cluster still serves every slot."""
    cluster = LocalRedisCluster(tmp_path / "cluster")
    picked = [n.port for n in cluster.nodes]
    assert all(p + 10000 < _ephemeral_low() for p in picked)  # below the ephemeral range
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", picked[0]))
    squatter.listen()
    try:
        with cluster:
            assert cluster.nodes[0].port != picked[0]
            assert [n.port for n in cluster.nodes[1:]] == picked[1:]
            assert b"Address already in use" in (tmp_path / "cluster" / str(picked[0]) / "redis.log").read_bytes()
            with redis.RedisCluster.from_url(cluster.url) as client:
                client.set(b"k", b"v")
                assert client.get(b"k") == b"v"
    finally:
        squatter.close()


def test_a_local_cluster_on_given_ports_does_not_move_a_node(tmp_path: Path) -> None:
    """Ports wired into other services' configs (compose_local) stay: a taken one fails the
    start, naming it; a wrong count is refused before anything starts."""
    ports = free_ports(6)
    with pytest.raises(ValueError, match="3 masters and 3 replicas need 6 ports, got"):
        LocalRedisCluster(tmp_path / "few", ports=ports[:5])
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", ports[2]))
    squatter.listen()
    cluster = LocalRedisCluster(tmp_path / "cluster", ports=ports)
    try:
        with pytest.raises(RuntimeError, match=f"redis-server on port {ports[2]} did not start"):
            cluster.start()
        assert [n.port for n in cluster.nodes] == ports
    finally:
        cluster.stop()
        squatter.close()
