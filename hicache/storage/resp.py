"""The Redis tier's data path on the wire (RESP2 and RESP3), without redis-py's pipeline.

redis-py joins a stored page's header and payload into one value before sending it, and
reads every reply into new bytes through its parser: the page is copied twice more than it
must be, and a 1.5 MB GET is parsed at about 0.5 GB/s. Here a command's value may be
`Parts` (several buffers sent as one bulk string, each large one as it is), and a bulk reply
is received straight into a buffer the caller chooses (`into`), with no copy in between.

Connections are made with a redis-py client's connection class and arguments, so the URL's
password, database, TLS, protocol (RESP2 or 3) and timeouts apply as before; once
connected, this module drives the socket. Replies keep redis-py's types: b"OK" for a
status, int, a memoryview for a bulk string, None for nil, and the redis-py exception for an
error reply (MOVED, ASK, WRONGTYPE, ...). A broken or slow connection raises
redis.ConnectionError or redis.TimeoutError and is closed; so does an error reply that says
the server cannot serve (LOADING, NOAUTH, ...).

Replies are parsed by resp_reader.Reader; this module packs and sends commands and keeps the
connections.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from hicache.storage.base import Buffer, skip_done
from hicache.storage.resp_reader import Reader, error_reply  # noqa: F401 - error_reply: tests import it from here

Into = Callable[[int, int], memoryview | None]  # (command index, bulk length) -> where to put it

SEND_APART = 16 << 10  # a value piece at least this long is sent as its own buffer, not copied
SEND_GATHER = 64  # buffers per sendmsg (IOV_MAX is 1024 on Linux)


class Parts(tuple[Buffer, ...]):
    """One bulk-string argument sent as the concatenation of its buffers."""


def pack(commands: Sequence[Sequence[Any]]) -> list[Buffer]:
    """The commands as RESP2 arrays of bulk strings: a list of buffers to send in order.
    Small pieces are joined; value pieces of SEND_APART bytes or more are sent as they are.
    Raises TypeError for an argument that is not bytes-like, str, int or Parts."""
    out: list[Buffer] = []
    small = bytearray()
    for command in commands:
        small += b"*%d\r\n" % len(command)
        for arg in command:
            pieces = _pieces(arg)
            small += b"$%d\r\n" % sum(p.nbytes for p in pieces)
            for piece in pieces:
                if piece.nbytes >= SEND_APART:
                    if small:
                        out.append(small)
                    out.append(piece)
                    small = bytearray()
                else:
                    small += piece
            small += b"\r\n"
    if small:
        out.append(small)
    return out


def send_all(sock: socket.socket, chunks: Sequence[Buffer]) -> None:
    """Send the chunks in order: gathered, up to SEND_GATHER buffers per sendmsg (a page sent
    as its pieces costs a few system calls, not one per piece), or one sendall per chunk on a
    socket without sendmsg (TLS). Raises OSError as sendall does."""
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        for chunk in chunks:
            sock.sendall(chunk)
        return
    views = [memoryview(c).cast("B") for c in chunks]
    at = 0
    while at < len(views):
        at = skip_done(views, at, sock.sendmsg(views[at : at + SEND_GATHER]))


def _pieces(arg: Any) -> list[memoryview]:
    if isinstance(arg, Parts):
        return [memoryview(p).cast("B") for p in arg]
    if isinstance(arg, bytes | bytearray | memoryview):
        return [memoryview(arg).cast("B")]
    if isinstance(arg, str):
        return [memoryview(arg.encode())]
    if isinstance(arg, int) and not isinstance(arg, bool):
        return [memoryview(b"%d" % arg)]
    raise TypeError(f"a redis argument must be bytes-like, str, int or Parts, got {type(arg).__name__}")


class _Wire:
    """One connected socket, with the redis-py connection that made it (kept to close it)."""

    def __init__(self, conn: Any):
        conn.connect()  # the URL's AUTH, SELECT, TLS handshake and socket timeout
        sock = getattr(conn, "_sock", None)
        if not isinstance(sock, socket.socket):
            import redis

            conn.disconnect()
            raise redis.ConnectionError(f"redis-py's {type(conn).__name__} gave no socket to drive")
        self.conn, self.sock, self.reader = conn, sock, Reader(sock)

    def usable(self) -> bool:
        """False when the server has closed the connection (or sent something unasked for)
        while it sat idle: it is then readable."""
        import ssl

        if self.reader.pending or (isinstance(self.sock, ssl.SSLSocket) and self.sock.pending()):
            return False
        poller = select.poll()  # not select(): no limit on the descriptor's number
        poller.register(self.sock, select.POLLIN | select.POLLPRI)
        try:
            return not poller.poll(0)
        except OSError:
            return False

    def close(self) -> None:
        self.conn.disconnect()

    def forget(self) -> None:
        """Close this process's descriptor of a connection inherited through fork, without
        shutdown(): that would end the connection for the parent too."""
        self.sock.close()


class Wires:
    """Connections to the server of a redis-py client (redis.Redis), reused between calls,
    one per concurrent caller. They are made with the client pool's connection class and
    arguments, outside its count (max_connections does not apply). Thread-safe. A forked
    child never uses the parent's connections: the server would answer both on one socket."""

    _all: weakref.WeakSet[Wires] = weakref.WeakSet()

    def __init__(self, client: Any):
        self.client = client
        self._idle: list[_Wire] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()  # the process whose connections _idle holds
        Wires._all.add(self)

    @classmethod
    def forget_after_fork(cls) -> None:
        """In a forked child: drop every inherited idle connection (the parent's) and start
        with a new lock, as a parent thread may have held the old one at the fork."""
        for wires in list(cls._all):
            wires._lock = threading.Lock()
            wires.forget_inherited()

    def forget_inherited(self) -> None:
        """Drop the idle connections if another process (the parent before a fork) made them."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():  # another thread of this process was first
                return
            inherited, self._idle, self._pid = self._idle, [], os.getpid()
        for wire in inherited:
            wire.forget()

    def execute(self, commands: Sequence[Sequence[Any]], into: Into | None = None) -> list[Any]:
        """Send `commands` as one pipeline and return their replies in order; a bulk reply to
        command i of length n goes into into(i, n) when that is a writable buffer of n bytes.
        Raises redis.ConnectionError / TimeoutError, also for an error reply that says the
        server cannot serve (LOADING, NOAUTH, ...), as redis-py does; the connection is then
        closed. Other error replies are that command's reply."""
        import redis

        wire = self._take()
        try:
            send_all(wire.sock, pack(commands))
            replies = [wire.reader.reply(None if into is None else _bound(into, i)) for i in range(len(commands))]
        except BaseException as exc:
            wire.close()
            if isinstance(exc, socket.timeout):
                raise redis.TimeoutError(f"redis: timed out ({exc})") from exc
            if isinstance(exc, OSError):
                raise redis.ConnectionError(f"redis: {type(exc).__name__}: {exc}") from exc
            raise
        refused = next((r for r in replies if isinstance(r, redis.ConnectionError)), None)
        if refused is not None:
            wire.close()
            raise refused
        with self._lock:
            keep = not self._closed
            if keep:
                self._idle.append(wire)
        if not keep:
            wire.close()
        return replies

    def _take(self) -> _Wire:
        self.forget_inherited()
        while True:
            with self._lock:
                wire = self._idle.pop() if self._idle else None
            if wire is None:
                pool = self.client.connection_pool
                return _Wire(pool.connection_class(**pool.connection_kwargs))
            if wire.usable():
                return wire
            wire.close()  # closed by the server while idle (a restart, a timeout): a new one

    def close(self) -> None:
        """Close the idle connections, and each busy one when its call ends."""
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for wire in idle:
            wire.close()


def _bound(into: Into, i: int) -> Callable[[int], memoryview | None]:
    return lambda size: into(i, size)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=Wires.forget_after_fork)
