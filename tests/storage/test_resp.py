"""The Redis tier's own wire (hicache.storage.resp): commands packed without copying large
values, replies read (RESP2 and RESP3) straight into the caller's buffers, error replies as
redis-py's exceptions, and broken or slow connections, against a socket pair and a real
redis-server; and the tier over a password, a database number and TLS, which redis-py's
connections set up for the wire."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from helpers import eventually, held_by_another_thread, in_forked_child, redis_binary
from redis import exceptions as rx
from tier_helpers import GEOMETRIES, free_port, identity, key, payload

from hicache.storage.redis import RedisTier
from hicache.storage.resp import SEND_APART, Parts, Reader, Wires, error_reply, pack, send_all


def test_pack_sends_large_value_pieces_as_they_are_and_joins_the_rest():
    payload = bytearray(b"p" * SEND_APART)
    chunks = pack([("SET", b"k", Parts((b"head", payload)), "PX", 5), ("GET", b"k")])
    assert b"".join(bytes(c) for c in chunks) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\nhead" % (4 + SEND_APART)
        + bytes(payload)
        + b"\r\n$2\r\nPX\r\n$1\r\n5\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    )
    sent_apart = [c for c in chunks if isinstance(c, memoryview)]
    assert len(sent_apart) == 1 and sent_apart[0].obj is payload  # the caller's buffer, not a copy
    assert len(chunks) == 3  # everything small is joined around it


@pytest.mark.parametrize("bad", [1.5, None, True, ["x"]])
def test_pack_refuses_an_argument_it_cannot_send_naming_its_type(bad):
    with pytest.raises(TypeError, match=type(bad).__name__):
        pack([("SET", b"k", bad)])


@pytest.mark.parametrize(
    ("message", "cls", "text"),
    [
        ("MOVED 3999 127.0.0.1:6381", rx.MovedError, "3999 127.0.0.1:6381"),
        ("ASK 3999 127.0.0.1:6381", rx.AskError, "3999 127.0.0.1:6381"),
        ("LOADING Redis is loading", rx.BusyLoadingError, "LOADING Redis is loading"),
        ("WRONGTYPE Operation against a key", rx.ResponseError, "WRONGTYPE Operation against a key"),
        ("OOM command not allowed", rx.OutOfMemoryError, "OOM command not allowed"),
    ],
)
def test_error_replies_become_redis_py_exceptions(message, cls, text):
    exc = error_reply(message)
    assert type(exc) is cls and str(exc) == text
    if cls is rx.AskError:
        assert exc.slot_id == 3999 and exc.node_addr == ("127.0.0.1", 6381)


@pytest.mark.parametrize("message", ["MOVED oops", "ASK 12", "MOVED 12 nohost", "ASK x 127.0.0.1:7000", "MOVED"])
def test_a_malformed_redirect_is_a_plain_error_reply(message):
    """redis-py's MovedError and AskError parse "<slot> <host>:<port>" and raise ValueError
    for anything else: that must not escape the reader."""
    exc = error_reply(message)
    assert type(exc) is rx.ResponseError and str(exc) == message


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(5)
    yield a, b
    a.close()
    b.close()


def dribble(sock: socket.socket, data: bytes, step: int) -> threading.Thread:
    """Send `data` `step` bytes at a time, so that replies arrive cut at every boundary."""

    def run() -> None:
        for i in range(0, len(data), step):
            sock.sendall(data[i : i + step])
            time.sleep(0)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("step", [1, 7, 1 << 20])
def test_reader_parses_resp2_and_resp3_replies_cut_anywhere(pair, step):
    big = bytes(range(256)) * 300  # longer than the reader's buffer when step is large
    wire = (
        b"+OK\r\n:42\r\n(12345678901234567890\r\n$-1\r\n_\r\n#t\r\n,1.5\r\n"
        + b"$%d\r\n" % len(big)
        + big
        + b"\r\n-WRONGTYPE bad\r\n!11\r\nMOVED 7 h:1\r\n=8\r\ntxt:abcd\r\n*2\r\n$1\r\na\r\n:1\r\n%1\r\n+k\r\n+v\r\n"
    )
    t = dribble(pair[1], wire, step)
    reader = Reader(pair[0])
    got = [reader.reply() for _ in range(13)]
    t.join()
    assert got[:7] == [b"OK", 42, 12345678901234567890, None, None, True, 1.5]
    assert bytes(got[7]) == big
    assert isinstance(got[8], rx.ResponseError) and str(got[8]) == "WRONGTYPE bad"
    assert isinstance(got[9], rx.MovedError) and got[9].slot_id == 7
    assert got[10] == b"abcd"
    assert [bytes(got[11][0]), got[11][1]] == [b"a", 1]
    assert got[12] == [b"k", b"v"]  # a map, as its keys and values in turn


@pytest.mark.parametrize("step", [3, 1 << 20])
def test_a_bulk_reply_lands_in_the_buffer_it_is_given(pair, step):
    body = b"x" * 100_000
    t = dribble(pair[1], b"$%d\r\n%s\r\n$3\r\nabc\r\n" % (len(body), body), step)
    reader = Reader(pair[0])
    target = bytearray(len(body))
    got = reader.reply(lambda n: memoryview(target) if n == len(target) else None)
    assert got.obj is target and bytes(target) == body
    other = reader.reply(lambda n: memoryview(target))  # the wrong size: a buffer of its own
    t.join()
    assert bytes(other) == b"abc" and other.obj is not target


def test_unknown_reply_type_and_a_closed_connection(pair):
    pair[1].sendall(b"?what\r\n")
    with pytest.raises(rx.InvalidResponse, match="unexpected reply type"):
        Reader(pair[0]).reply()
    pair[1].sendall(b"$10\r\nabc")
    pair[1].close()
    with pytest.raises(ConnectionResetError):
        Reader(pair[0]).reply()


@pytest.mark.parametrize("protocol", [2, 3])
def test_wires_against_a_real_server(redis_server, protocol):
    client = redis.Redis.from_url(redis_server.url, protocol=protocol)
    wires = Wires(client)
    value = bytes(range(256)) * 400
    target = bytearray(len(value) + 2)
    replies = wires.execute(
        [
            ("SET", b"page", Parts((b"hd", value))),
            ("GET", b"page"),
            ("GET", b"absent"),
            ("STRLEN", b"page"),
            ("HSET", b"h", b"f", b"v"),
            ("GET", b"h"),
        ],
        lambda i, n: memoryview(target) if i == 1 else None,
    )
    assert replies[0] == b"OK" and replies[1].obj is target and bytes(target) == b"hd" + value
    assert replies[2] is None and replies[3] == len(value) + 2 and replies[4] == 1
    assert isinstance(replies[5], rx.ResponseError) and str(replies[5]).startswith("WRONGTYPE")
    assert client.get(b"page") == b"hd" + value  # what redis-py reads back is what was sent
    # one connection, reused
    assert wires.execute([("PING",)]) == [b"PONG"] and len(wires._idle) == 1
    wires.close()
    client.close()


def test_a_dead_server_raises_connection_error_then_a_new_connection_works(redis_server):
    wires = Wires(redis.Redis.from_url(redis_server.url, socket_timeout=2))
    assert wires.execute([("SET", b"a", b"1")]) == [b"OK"]
    redis_server.stop()
    with pytest.raises(redis.ConnectionError):
        wires.execute([("GET", b"a")])
    assert wires._idle == []  # the broken connection was closed, not kept
    redis_server.start()
    assert wires.execute([("SET", b"a", b"2"), ("GET", b"a")])[0] == b"OK"
    wires.close()


class FakeServer:
    """A loopback server that answers redis-py's handshake (+OK to each command), then
    `answer` (bytes) to the first command that holds `trigger`, or nothing when answer is None."""

    def __init__(self, trigger: bytes, answer: bytes | None):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, args=(trigger, answer), daemon=True)
        self.thread.start()

    def _serve(self, trigger: bytes, answer: bytes | None) -> None:
        conn, _ = self.listener.accept()
        self.accepted.append(conn)
        while trigger not in (data := conn.recv(65536)) and data:
            conn.sendall(b"+OK\r\n" * data.count(b"\r\n*") + b"+OK\r\n" * data.startswith(b"*"))
        if answer is not None:
            conn.sendall(answer)

    def close(self) -> None:
        self.thread.join(10)
        for s in self.accepted:
            s.close()
        self.listener.close()


def test_a_server_that_stops_answering_raises_timeout_error():
    server = FakeServer(b"GET", None)
    wires = Wires(redis.Redis(port=server.port, socket_timeout=0.3, protocol=2))
    with pytest.raises(redis.TimeoutError):
        wires.execute([("GET", b"a")])
    assert wires._idle == []
    server.close()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"-LOADING Redis is loading the dataset in memory\r\n", rx.BusyLoadingError),  # the server cannot serve
        (b"-NOAUTH Authentication required.\r\n", rx.AuthenticationError),
        (b"$3\r\nabcXY", rx.InvalidResponse),  # no CRLF after the bulk string
        (b":12a\r\n", rx.InvalidResponse),  # not a number
        (b"$99999999999999999999\r\n", rx.InvalidResponse),  # a length no buffer can have
        (b"$999999999999\r\n", rx.InvalidResponse),  # 1 TB: over Redis's proto-max-bulk-len
        (b"!99999999999999999999\r\n", rx.InvalidResponse),  # a RESP3 blob error as long
    ],
)
def test_replies_that_fail_the_whole_batch_close_the_connection(answer, error):
    server = FakeServer(b"GET", b"+OK\r\n" + answer)
    wires = Wires(redis.Redis(port=server.port, socket_timeout=2, protocol=2))
    with pytest.raises(error):
        wires.execute([("SET", b"a", b"1"), ("GET", b"a")])
    assert wires._idle == []  # not reused: what follows on it is unknown
    server.close()


@pytest.mark.parametrize("answer", [b"$99999999999999999999\r\n", b"$999999999999\r\n", b"-MOVED oops\r\n"])
def test_a_tier_reading_a_reply_it_cannot_take_misses_and_does_not_raise(answer):
    server = FakeServer(b"GET", answer)
    tier = RedisTier(identity(GEOMETRIES["mimo_kv"]), f"redis://127.0.0.1:{server.port}/0?protocol=2")
    assert tier.get(key(0)) is None
    stats = tier.stats()
    assert stats.misses == 1 and stats.errors >= 1 and stats.last_error
    tier.close()
    server.close()


def test_a_forked_child_makes_connections_of_its_own_and_leaves_the_parents_open(redis_server):
    """A child that sent on the parent's idle connection would read the parent's replies (and
    the parent the child's); one that shut it down would close it for the parent too."""
    client = redis.Redis.from_url(redis_server.url)
    wires = Wires(client)
    (parent_id,) = wires.execute([("CLIENT", "ID")])

    def child() -> bool:
        (child_id,) = wires.execute([("CLIENT", "ID")])
        return child_id != parent_id and all(w.sock.fileno() >= 0 for w in wires._idle)

    assert in_forked_child(child)
    assert wires.execute([("CLIENT", "ID")]) == [parent_id] and len(wires._idle) == 1  # the same one, still open
    wires.close()
    client.close()


def test_a_forked_child_is_not_blocked_by_a_lock_a_parent_thread_held_at_the_fork(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    wires = Wires(client)
    assert wires.execute([("PING",)]) == [b"PONG"]

    def child() -> bool:
        return wires.execute([("PING",)]) == [b"PONG"] and wires._pid == os.getpid()

    with held_by_another_thread(wires._lock):
        assert in_forked_child(child, timeout=60)
    wires.close()
    client.close()


def test_resp3_push_messages_and_attributes_are_skipped(pair):
    pair[1].sendall(b">2\r\n+invalidate\r\n*1\r\n$1\r\nk\r\n+OK\r\n|1\r\n+ttl\r\n:3\r\n:5\r\n")
    reader = Reader(pair[0])
    assert reader.reply() == b"OK" and reader.reply() == 5


def test_an_idle_connection_the_server_closed_is_replaced_not_failed(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    wires = Wires(client)
    assert wires.execute([("CLIENT", "SETNAME", "hicache-wire")]) == [b"OK"]
    assert client.client_kill_filter(_type="normal", skipme=True) >= 1  # what a restart or an idle timeout does
    eventually(lambda: "hicache-wire" not in [c["name"] for c in client.client_list()])
    assert wires.execute([("SET", b"a", b"1"), ("GET", b"a")])[0] == b"OK"  # a new connection, no error
    wires.close()
    client.close()


def test_a_close_during_a_call_closes_that_connection_when_the_call_ends(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    wires = Wires(client)
    wires.execute([("SET", b"a", b"xyz")])

    def close_meanwhile(i: int, size: int) -> None:
        wires.close()

    got = wires.execute([("CLIENT", "SETNAME", "busy"), ("GET", b"a")], close_meanwhile)
    assert bytes(got[1]) == b"xyz" and wires._idle == []
    eventually(lambda: "busy" not in [c["name"] for c in client.client_list()])  # closed, not kept
    client.close()


def spawn_redis(tmp_path, url: str, args: list[str]) -> subprocess.Popen[bytes]:
    """A redis-server with `args`, once a redis-py client at `url` gets PONG."""
    exe = redis_binary()
    proc = subprocess.Popen([exe, "--save", "", "--appendonly", "no", "--dir", str(tmp_path), "--bind", "127.0.0.1", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        try:
            with redis.Redis.from_url(url, socket_timeout=1) as probe:
                if probe.ping():
                    return proc
        except redis.RedisError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start: {args}") from None
            time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(10)


def test_the_tier_over_a_password_and_a_database_number(tmp_path):
    port = free_port()
    url = f"redis://:s3cret@127.0.0.1:{port}/3"
    proc = spawn_redis(tmp_path, url, ["--port", str(port), "--requirepass", "s3cret"])
    try:
        g = GEOMETRIES["mimo_kv"]
        tier = RedisTier(identity(g), url)
        assert tier.batch_set([(key(i), payload(g, i)) for i in range(3)]) == [True] * 3
        got: dict[int, bytes] = {}
        assert tier.batch_read([key(0), key(1), key(2)], lambda i, d: got.__setitem__(i, bytes(d))) == 3
        assert [got[i] for i in range(3)] == [payload(g, i) for i in range(3)]
        with redis.Redis.from_url(url) as raw:
            assert raw.dbsize() == 3  # in database 3 ...
            raw.select(0)
            assert raw.dbsize() == 0  # ... not 0
        tier.close()
        wrong = RedisTier(identity(g), f"redis://:nope@127.0.0.1:{port}/3")
        assert wrong.batch_get([key(0)]) == [None] and wrong.set(key(0), payload(g, 0)) is False
        assert "invalid" in wrong.stats().last_error.lower() or "auth" in wrong.stats().last_error.lower()
        wrong.close()
    finally:
        stop(proc)


def test_the_tier_over_tls(tmp_path):
    redis_binary("openssl")
    cert, private = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", private, "-out", cert, "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    tls = ["--tls-cert-file", cert, "--tls-key-file", private, "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
    proc = spawn_redis(tmp_path, url, ["--port", "0", "--tls-port", str(port), *map(str, tls)])
    try:
        g = GEOMETRIES["mimo_kv"]
        tier = RedisTier(identity(g), url)
        pages = [(key(i), payload(g, i)) for i in range(4)]
        assert tier.batch_set(pages) == [True] * 4
        got: dict[int, bytes] = {}
        assert tier.batch_read([k for k, _ in pages], lambda i, d: got.__setitem__(i, bytes(d))) == 4
        assert [got[i] for i in range(4)] == [p for _, p in pages]
        assert [bytes(x) for x in tier.batch_get([k for k, _ in pages]) if x is not None] == [p for _, p in pages]
        tier.close()
    finally:
        stop(proc)


def test_send_all_gathers_many_buffers_through_partial_sends() -> None:
    """More buffers than one sendmsg takes, a socket buffer far smaller than the data (every
    sendmsg is partial, often mid-buffer), and empty buffers: the peer gets exactly the
    concatenation."""
    rng = random.Random(5)
    chunks = [rng.randbytes(rng.choice([0, 1, 700, 20_000, 81_920])) for _ in range(300)]
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    received = bytearray()

    def drain() -> None:
        while data := right.recv(1 << 16):
            received.extend(data)

    reader = threading.Thread(target=drain)
    reader.start()
    send_all(left, [memoryview(c) for c in chunks])
    left.close()
    reader.join(60)
    right.close()
    assert not reader.is_alive() and bytes(received) == b"".join(chunks)
