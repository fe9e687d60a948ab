"""How the Redis tier reaches its server: one server (ServerLink) or a cluster (ClusterLink,
in redis_cluster_link). A link runs a batch of single-key commands and answers one reply per
command, an Exception instance for a command that failed; it never raises for the server's
sake. A server (or cluster node) that is unreachable or too slow is backed off: until
`retry_at`, commands for it fail at once without touching the network.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hicache.storage.base import TierHealth
from hicache.storage.resp import Into, Wires

# ("GET", key), ("SET", key, value, "PX", ms), ...: the key is second, but for a script's
# ("EVAL", script, 1, key, arg, ...), whose one key is fourth (see command_key)
Command = tuple[Any, ...]


class Backoff:
    """Health of one server: healthy, or down until retry_at, the wait doubling from
    initial_s to max_s with each failure in a row. Failures reported while the server is
    already backed off (calls that were under way when it went down) do not double it
    again: one outage seen by many threads at once is one step. Thread-safe."""

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float]):
        self._initial, self._max, self._clock = initial_s, max_s, clock
        self._lock = threading.Lock()
        self.healthy = True
        self._wait = 0.0
        self.retry_at = 0.0

    def blocked(self) -> bool:
        """True while down and the backoff has not run out (do not try the server)."""
        with self._lock:
            return not self.healthy and self._clock() < self.retry_at

    def due(self) -> bool:
        """True when down and the backoff has run out (a probe may try it)."""
        with self._lock:
            return not self.healthy and self._clock() >= self.retry_at

    def failed(self) -> None:
        with self._lock:
            now = self._clock()
            if not self.healthy and now < self.retry_at:
                return  # the same outage, from another call in flight when it began
            self.healthy = False
            self._wait = min(self._max, max(self._initial, self._wait * 2))
            self.retry_at = now + self._wait

    def ok(self) -> None:
        with self._lock:
            self.healthy, self._wait = True, 0.0

    def retry_in(self) -> float:
        with self._lock:
            return max(0.0, self.retry_at - self._clock())


class Link(Protocol):
    def run(self, commands: Sequence[Command], into: Into | None = None) -> list[Any]:
        """One reply per command, in order: a value, or an Exception for a failed command. A
        value may be resp.Parts; a bulk reply to command i of n bytes lands in into(i, n)
        when that gives a buffer of n bytes (see resp.Wires.execute)."""

    def health(self) -> TierHealth:
        """Whether every key can be served now; probes what is down once its backoff ran out."""

    def nodes_down(self) -> list[str]:
        """host:port of each server that is down now."""

    def close(self) -> None: ...


def command_key(command: Command) -> Any:
    """The one key `command` touches: where a cluster sends it."""
    return command[3] if command[0] in ("EVAL", "EVALSHA") else command[1]


def down_errors() -> tuple[type[Exception], ...]:
    """The errors that say a server is unreachable or too slow (as opposed to an error reply)."""
    import redis

    return (redis.ConnectionError, redis.TimeoutError, OSError)


def redis_errors() -> tuple[type[Exception], ...]:
    """Every error redis-py raises for the server's sake (RedisClusterException is not a RedisError)."""
    import redis
    from redis.exceptions import RedisClusterException

    return (redis.RedisError, RedisClusterException, OSError)


class ServerLink:
    """One Redis server at `url`: a batch is one pipeline on one connection (resp.Wires)."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        backoff: Backoff,
        on_error: Callable[[str], None],
    ):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self._backoff, self._on_error = backoff, on_error
        self._down = down_errors()
        self._errors = redis_errors()
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self._wires = Wires(self.client)

    def run(self, commands: Sequence[Command], into: Into | None = None) -> list[Any]:
        if not commands:
            return []
        if self._backoff.blocked():
            return [_blocked(self.url, self._backoff)] * len(commands)
        try:
            replies = self._wires.execute(commands, into)  # an error reply fails its command only
        except self._errors as exc:
            if isinstance(exc, self._down):
                self._backoff.failed()
            self._on_error(f"redis {self.url}: {type(exc).__name__}: {exc}")
            return [exc] * len(commands)
        self._backoff.ok()
        return replies

    def health(self) -> TierHealth:
        if self._backoff.due():
            try:
                self.client.ping()
                self._backoff.ok()
            except self._errors as exc:
                self._backoff.failed()
                self._on_error(f"redis {self.url}: {type(exc).__name__}: {exc}")
        if self._backoff.healthy:
            return TierHealth(True)
        return TierHealth(False, f"redis {self.url} unreachable; retry in {self._backoff.retry_in():.2f}s")

    def nodes_down(self) -> list[str]:
        return [] if self._backoff.healthy else [self.url]

    def close(self) -> None:
        self._wires.close()
        self.client.close()


def _blocked(where: str, backoff: Backoff) -> Exception:
    import redis

    return redis.ConnectionError(f"{where} is down; retry in {backoff.retry_in():.2f}s")
