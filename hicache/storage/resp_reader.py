"""RESP2 and RESP3 replies read from a socket: the receiving half of the Redis tier's wire (resp).

A bulk reply is received straight into a buffer the caller chooses, the part already read
ahead copied first and the rest by recv_into, with no copy in between. Replies keep
redis-py's types: b"OK" for a status, int, a memoryview for a bulk string, None for nil, and
the redis-py exception for an error reply (MOVED, ASK, WRONGTYPE, ...). A malformed reply
raises redis's InvalidResponse; a connection the server closed, ConnectionResetError.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

READ_BYTES = 64 << 10  # the reply reader's buffer (status lines, small replies, headers)
MAX_BULK_BYTES = 512 << 20  # the longest bulk reply taken: Redis's own proto-max-bulk-len default


def error_reply(message: str) -> Exception:
    """The redis-py exception for an error reply `message` (without its leading '-')."""
    from redis import exceptions as rx

    code, _, rest = message.partition(" ")
    by_code: dict[str, tuple[type[Exception], str]] = {
        "MOVED": (rx.MovedError, rest),
        "ASK": (rx.AskError, rest),
        "LOADING": (rx.BusyLoadingError, message),
        "READONLY": (rx.ReadOnlyError, message),
        "CLUSTERDOWN": (rx.ClusterDownError, message),
        "TRYAGAIN": (rx.TryAgainError, message),
        "OOM": (rx.OutOfMemoryError, message),
        "NOPERM": (rx.NoPermissionError, message),
        "NOAUTH": (rx.AuthenticationError, message),
        "WRONGPASS": (rx.AuthenticationError, message),
        "MASTERDOWN": (rx.MasterDownError, message),
    }
    if message.startswith("ERR max number of clients reached"):
        return rx.MaxClientsReachedError(message)
    cls, text = by_code.get(code, (rx.ResponseError, message))
    try:
        return cls(text)
    except ValueError:  # a MOVED or ASK without "<slot> <host>:<port>": no redirect to follow
        return rx.ResponseError(message)


class Reader:
    """RESP2 and RESP3 replies from a socket. Bulk strings are received into the buffer `into` names
    (or a new one), the part already read ahead copied first, the rest by recv_into."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._buf = bytearray(READ_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def reply(self, into: Callable[[int], memoryview | None] | None = None) -> Any:
        while True:
            line = self._line()
            kind, rest = line[:1], line[1:]
            if kind not in (b">", b"|"):
                break
            # RESP3 out of band: a push message (redis-py's maintenance notices), or the
            # attributes of the reply that follows; read and dropped
            for _ in range(_count(rest) * (2 if kind == b"|" else 1)):
                self.reply()
        if kind == b"$":
            size = _length(rest)
            if size < 0:
                return None
            dest = into(size) if into is not None else None
            if dest is not None:
                dest = dest.cast("B") if dest.format != "B" else dest
            if dest is None or dest.nbytes != size or dest.readonly:
                dest = memoryview(bytearray(size))
            self._exact(dest)
            self._crlf()
            return dest
        if kind == b"+":
            return rest
        if kind == b"-":
            return error_reply(rest.decode(errors="replace"))
        if kind in (b":", b"("):
            return _count(rest)
        if kind == b"_":  # RESP3 (a connection that said HELLO 3): null
            return None
        if kind == b"#":
            return rest == b"t"
        if kind == b",":
            try:
                return float(rest)
            except ValueError:
                raise _protocol_error(f"bad double {rest[:40]!r}") from None
        if kind in (b"!", b"="):  # blob error, verbatim string ("txt:..."): length-prefixed
            body = memoryview(bytearray(max(0, _length(rest))))
            self._exact(body)
            self._crlf()
            text = bytes(body)
            return error_reply(text.decode(errors="replace")) if kind == b"!" else text[4:]
        if kind in (b"*", b"~", b"%"):  # array, set, map (as a flat list of keys and values)
            count = _count(rest)
            return None if count < 0 else [self.reply() for _ in range(count * (2 if kind == b"%" else 1))]
        raise _protocol_error(f"unexpected reply type {line[:40]!r}")

    def _crlf(self) -> None:
        end = memoryview(bytearray(2))
        self._exact(end)
        if end != b"\r\n":
            raise _protocol_error(f"a bulk string ends with {bytes(end)!r}, not CRLF")

    @property
    def pending(self) -> int:
        """Bytes read from the socket and not yet parsed."""
        return self._end - self._start

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._start, self._end)
            if end >= 0:
                line = bytes(self._view[self._start : end])
                self._start = end + 2
                return line
            if self._start == 0 and self._end == len(self._buf):
                raise _protocol_error(f"a reply line longer than {len(self._buf)} bytes")
            self._fill()

    def _fill(self) -> None:
        if self._start > 0:  # keep the unread tail at the front
            pending = self.pending
            self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        got = self._sock.recv_into(self._view[self._end :])
        if got == 0:
            raise ConnectionResetError("the server closed the connection")
        self._end += got

    def _exact(self, dest: memoryview) -> None:
        have = min(dest.nbytes, self.pending)
        dest[:have] = self._view[self._start : self._start + have]
        self._start += have
        while have < dest.nbytes:
            got = self._sock.recv_into(dest[have:])
            if got == 0:
                raise ConnectionResetError("the server closed the connection")
            have += got


def _count(text: bytes) -> int:
    """A reply's length or integer; InvalidResponse for anything else."""
    try:
        return int(text)
    except ValueError:
        raise _protocol_error(f"bad number {text[:40]!r}") from None


def _length(text: bytes) -> int:
    """A bulk reply's length (-1 for nil); InvalidResponse above MAX_BULK_BYTES, which no
    server sends (it would not fit in memory here)."""
    size = _count(text)
    if size > MAX_BULK_BYTES:
        raise _protocol_error(f"a bulk reply of {size} bytes, over the {MAX_BULK_BYTES} taken")
    return size


def _protocol_error(detail: str) -> Exception:
    from redis.exceptions import InvalidResponse

    return InvalidResponse(f"redis protocol error: {detail}")
