import socket

import pytest
from tier_helpers import GEOMETRIES, GEOMETRY_NAMES, RedisServer, identity, key, payload

from hicache.storage.redis import RedisTier


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_flipped_byte_in_a_redis_value_is_a_miss(redis_server, name):
    g = GEOMETRIES[name]
    tier = RedisTier(identity(g), redis_server.url)
    assert tier.batch_set([(key(i), payload(g, i)) for i in range(3)]) == [True] * 3
    raw = redis_server.client()
    value = bytearray(raw.get(tier.qualified(key(1))))
    value[len(value) // 2] ^= 0x10
    raw.set(tier.qualified(key(1)), bytes(value))
    got = tier.batch_get([key(0), key(1), key(2)])
    assert bytes(got[0]) == payload(g, 0) and got[1] is None and bytes(got[2]) == payload(g, 2)
    assert raw.exists(tier.qualified(key(1))) == 0  # deleted
    assert tier.stats().corrupt == 1
    tier.close()


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_two_sidecars_share_pages_two_namespaces_do_not(redis_server, name):
    g = GEOMETRIES[name]
    a, b = RedisTier(identity(g, "ns1"), redis_server.url), RedisTier(identity(g, "ns1"), redis_server.url)
    c = RedisTier(identity(g, "ns2"), redis_server.url)
    assert a.batch_set([(key(i), payload(g, i)) for i in range(4)]) == [True] * 4
    assert b.batch_exists([key(i) for i in range(6)]) == 4
    assert [bytes(x) for x in b.batch_get([key(3), key(0)]) if x is not None] == [payload(g, 3), payload(g, 0)]
    assert c.batch_exists([key(0)]) == 0 and c.get(key(0)) is None
    assert c.set(key(0), payload(g, 9)) and bytes(a.get(key(0))) == payload(g, 0)


def test_ttl_expires_pages(redis_server):
    g = GEOMETRIES["deepseek_mla"]
    tier = RedisTier(identity(g), redis_server.url, ttl_s=100)
    assert tier.set(key(1), payload(g, 1))
    assert 0 < redis_server.client().pttl(tier.qualified(key(1))) <= 100_000


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_redis_stopped_mid_run_then_restarted(redis_server, name):
    g = GEOMETRIES[name]
    clock = FakeClock()
    tier = RedisTier(identity(g), redis_server.url, timeout_s=2, backoff_initial_s=1, backoff_max_s=4, clock=clock)
    assert tier.set(key(0), payload(g, 0)) and tier.health().healthy
    redis_server.stop()
    # down: misses and failures, no exception, unhealthy in health() and stats()
    assert tier.get(key(0)) is None
    assert not tier.health().healthy and not tier.stats().healthy
    errors = tier.stats().errors
    assert tier.set(key(1), payload(g, 1)) is False and tier.batch_exists([key(0)]) == 0
    assert tier.stats().errors == errors, "within the backoff window, no connection attempt is made"
    clock.now += 1.5  # past the first backoff: the next call tries again, fails, backs off longer
    assert tier.get(key(0)) is None and tier.stats().errors == errors + 1
    assert "retry in 2.00s" in tier.health().detail
    redis_server.start()  # same port, empty (no persistence)
    assert not tier.health().healthy  # still backing off
    clock.now += 2.5
    assert tier.health().healthy  # the probe reconnects
    assert tier.set(key(1), payload(g, 1)) and bytes(tier.get(key(1))) == payload(g, 1)
    s = tier.stats()
    assert s.healthy and s.write_failures == 1 and s.writes == 2
    tier.close()


def test_unreachable_at_start_does_not_raise(tmp_path):
    g = GEOMETRIES["mimo_kv"]
    tier = RedisTier(identity(g), f"unix://{tmp_path}/nothing.sock", timeout_s=0.5)
    assert tier.get(key(0)) is None and not tier.set(key(0), payload(g, 0))
    assert not tier.health().healthy and "unreachable" in tier.health().detail


def test_batch_read_receives_pages_into_one_reused_buffer_and_stops_at_the_first_miss(redis_server):
    g = GEOMETRIES["mimo_kv"]
    tier = RedisTier(identity(g), redis_server.url)
    assert tier.batch_set([(key(i), payload(g, i)) for i in range(4)]) == [True] * 4
    seen: list[tuple[int, bytes, object]] = []

    def sink(i: int, data: memoryview) -> None:
        seen.append((i, bytes(data), data.obj))

    assert tier.batch_read([key(0), key(1), key(9), key(2)], sink) == 2
    assert [(i, b) for i, b, _ in seen] == [(0, payload(g, 0)), (1, payload(g, 1))]
    assert tier.batch_read([key(2), key(3)], sink) == 2
    assert bytes(seen[-1][1]) == payload(g, 3)
    assert len({id(obj) for _, _, obj in seen}) == 1  # every page landed in the same buffer
    raw = redis_server.client()
    value = bytearray(raw.get(tier.qualified(key(3))))
    value[-1] ^= 1
    raw.set(tier.qualified(key(3)), bytes(value))
    raw.set(tier.qualified(key(2)), b"short")  # another size: read apart, refused
    assert tier.batch_read([key(2)], sink) == 0 and tier.batch_read([key(0), key(3)], sink) == 1
    assert raw.exists(tier.qualified(key(2)), tier.qualified(key(3))) == 0 and tier.stats().corrupt == 2
    tier.close()


def test_the_test_redis_server_moves_off_a_port_taken_before_its_first_start(tmp_path):
    """The suite's RedisServer: a port another process took between drawing and binding it
    (redis-server exits at once) is replaced on the first start, and the url follows."""
    server = RedisServer(tmp_path)
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
        try:
            assert server.port != taken and server.url == f"redis://127.0.0.1:{server.port}/0"
            with server.client() as client:
                assert client.ping()
        finally:
            server.stop()


def test_the_test_redis_server_is_not_fooled_by_another_server_on_its_port(tmp_path):
    """A port another test's redis-server already holds answers PING, but not as ours: the
    new server still moves to a port of its own."""
    first = RedisServer(tmp_path / "a")
    (tmp_path / "a").mkdir()
    first.start()
    try:
        (tmp_path / "b").mkdir()
        second = RedisServer(tmp_path / "b")
        second.port = first.port
        second.start()
        try:
            assert second.port != first.port
            with second.client() as client:
                assert client.info("server")["process_id"] == second.proc.pid
        finally:
            second.stop()
    finally:
        first.stop()


def test_a_closed_tier_reports_closed_without_dialling_redis_again(redis_server):
    """A released pool's stats are read after its tier closed (metrics): health() must not
    probe (redis-py would open a new connection after close, or wait out a connect timeout)."""
    g = GEOMETRIES["deepseek_mla"]
    tier = RedisTier(identity(g), redis_server.url)
    assert tier.set(key(1), payload(g, 1)) and tier.health().healthy
    tier.close()

    def dialled() -> None:
        raise AssertionError("a closed tier probed Redis")

    tier._link.health = dialled  # type: ignore[method-assign]
    tier._link.nodes_down = dialled  # type: ignore[method-assign]
    health = tier.health()
    assert not health.healthy and "closed" in health.detail
    stats = tier.stats()
    assert (stats.healthy, stats.writes, stats.nodes_down) == (False, 1, [])


def test_one_outage_seen_by_many_calls_at_once_backs_off_one_step():
    """Six calls in flight when Redis went down each reported the failure, and the wait
    doubled six times (0.1 s -> 3.2 s of misses after a short blip); now it is one step, and
    only a failure after the wait ran out (a probe) doubles it."""
    from hicache.storage.redis_link import Backoff

    clock = FakeClock()
    backoff = Backoff(0.1, 10.0, clock)
    for _ in range(6):
        backoff.failed()
    assert backoff.retry_in() == pytest.approx(0.1) and backoff.blocked()
    clock.now = 0.1  # the wait ran out: a probe fails
    assert backoff.due()
    backoff.failed()
    assert backoff.retry_in() == pytest.approx(0.2)
    backoff.ok()
    assert not backoff.blocked() and not backoff.due()
    backoff.failed()  # a new outage starts again from the first step
    assert backoff.retry_in() == pytest.approx(0.1)
