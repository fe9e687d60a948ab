"""The Redis (or Valkey) tier: pages shared by every sidecar that points at one server.

Keys are b"hicache:<identity qualifier>:" + page key, values are pages in page_format.
Batches go through non-transactional pipelines. When the server is down or slow, every
operation returns a miss or a failure, the tier reports unhealthy, and it retries only
after an exponential backoff (backoff_initial_s doubling to backoff_max_s): in between,
calls return at once without touching the network, so a dead Redis costs the caller
nothing. The first successful call (or a health() probe after the backoff) makes the tier
healthy again. With ttl_s, pages expire ttl_s after their last write or read; a size cap
is Redis's own `maxmemory` with an LRU `maxmemory-policy`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hicache.storage import page_format as fmt
from hicache.storage.base import Buffer, StorageTier, TierHealth, TierIdentity

T = TypeVar("T")


def check_options(
    url: object, timeout_s: object, ttl_s: object, backoff_initial_s: object, backoff_max_s: object
) -> None:
    """Raise ValueError naming the first bad RedisTier option (also used to check a
    sidecar's extra config at start-up, before any pool registers)."""
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {url!r}")
    named = {"timeout_s": timeout_s, "backoff_initial_s": backoff_initial_s, "backoff_max_s": backoff_max_s}
    if ttl_s is not None:
        named["ttl_s"] = ttl_s
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if backoff_max_s < backoff_initial_s:  # type: ignore[operator]
        raise ValueError(f"backoff_max_s {backoff_max_s} is below backoff_initial_s {backoff_initial_s}")


class RedisTier(StorageTier):
    """Pages of `identity` in the Redis server at `url` ("redis://host:port/db" or
    "unix:///path/to.sock"). Needs the `redis` package (ImportError otherwise).

    Raises ValueError for a bad url, timeout_s, ttl_s or backoff. Does not connect in the
    constructor: an unreachable server makes the tier unhealthy, not the constructor fail.
    """

    backend = "redis"

    def __init__(
        self,
        identity: TierIdentity,
        url: str,
        *,
        timeout_s: float = 1.0,
        ttl_s: float | None = None,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 10.0,
        max_batch_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(identity)
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        check_options(url, timeout_s, ttl_s, backoff_initial_s, backoff_max_s)
        self.url = url
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        # the server is unreachable or too slow: back off; other errors (an error reply such
        # as OOM under maxmemory) fail the call but say nothing about the server's health
        self._down: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self.prefix = f"hicache:{identity.qualifier}:".encode()
        self._per_batch = max(1, max_batch_bytes // fmt.stored_size(identity, b"k" * 32))
        self._backoff_initial, self._backoff_max, self._clock = backoff_initial_s, backoff_max_s, clock
        self._state_lock = threading.Lock()  # guards the health state below
        self._healthy = True
        self._backoff = 0.0
        self._retry_at = 0.0

    def qualified(self, key: bytes) -> bytes:
        """The Redis key of page key `key`."""
        fmt.check_key(key)
        return self.prefix + key

    # ---- health and backoff -------------------------------------------------------------------
    def _call(self, fn: Callable[[], T], default: T) -> tuple[T, bool]:
        """Run fn against the server unless in backoff; (result, True) or (default, False)."""
        with self._state_lock:
            if not self._healthy and self._clock() < self._retry_at:
                return default, False
        try:
            result = fn()
        except self._errors as e:
            if not isinstance(e, self._down):
                self._error(f"redis {self.url}: {type(e).__name__}: {e}")
                return default, False
            with self._state_lock:
                self._healthy = False
                self._backoff = min(self._backoff_max, max(self._backoff_initial, self._backoff * 2))
                self._retry_at = self._clock() + self._backoff
            self._error(f"redis {self.url}: {type(e).__name__}: {e}")
            return default, False
        with self._state_lock:
            self._healthy, self._backoff = True, 0.0
        return result, True

    def health(self) -> TierHealth:
        with self._state_lock:
            healthy, due = self._healthy, self._clock() >= self._retry_at
        if not healthy and due:
            self._call(self._client.ping, None)
        with self._state_lock:
            if self._healthy:
                return TierHealth(True)
            return TierHealth(
                False, f"redis {self.url} unreachable; retry in {max(0.0, self._retry_at - self._clock()):.2f}s"
            )

    def close(self) -> None:
        self._client.close()

    # ---- reads --------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.batch_contains([key])[0]

    def batch_contains(self, keys: Sequence[bytes]) -> list[bool]:
        qkeys = [self.qualified(k) for k in keys]
        if not qkeys:
            return []

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for q in qkeys:
                pipe.strlen(q)  # 0 when absent; WRONGTYPE for a value that is not a string
            return list(pipe.execute(raise_on_error=False))

        replies, _ = self._call(run, [0] * len(keys))
        out, bad = [], []
        for key, q, n in zip(keys, qkeys, replies, strict=True):
            wrong = _wrong_type(n) or (isinstance(n, int) and n not in (0, fmt.stored_size(self.identity, key)))
            if wrong:  # what Reload would refuse: gone now, so that Lookup and Reload agree
                bad.append(q)
            out.append(not wrong and isinstance(n, int) and n > 0)
        self._drop_corrupt(bad)
        return out

    def _drop_corrupt(self, qkeys: list[bytes]) -> None:
        """Values under our page keys that are not pages (another type, another size): deleted,
        counted corrupt."""
        if qkeys:
            self._call(lambda: self._client.delete(*qkeys), 0)
            self._count(corrupt=len(qkeys))

    def get(self, key: bytes) -> memoryview | None:
        return self.batch_get([key])[0]

    def batch_get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        qkeys = [self.qualified(k) for k in keys]
        out: list[memoryview | None] = []
        for start in range(0, len(qkeys), self._per_batch):
            chunk = qkeys[start : start + self._per_batch]

            def run(chunk: list[bytes] = chunk) -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for q in chunk:
                    if self.ttl_ms is None:
                        pipe.get(q)
                    else:
                        pipe.getex(q, px=self.ttl_ms)
                return list(pipe.execute(raise_on_error=False))

            blobs, _ = self._call(run, [None] * len(chunk))
            wrong = []
            for key, q, blob in zip(keys[start : start + len(chunk)], chunk, blobs, strict=True):
                if _wrong_type(blob):
                    wrong.append(q)
                    out.append(None)
                else:
                    out.append(self._decode(key, None if isinstance(blob, Exception) else blob))
            self._drop_corrupt(wrong)
            self._count(misses=len(wrong))
        return out

    def _decode(self, key: bytes, blob: bytes | None) -> memoryview | None:
        if blob is None:
            self._count(misses=1)
            return None
        try:
            payload = fmt.decode_page(self.identity, key, blob)
        except fmt.PageError as e:
            if e.reason == "unreadable":  # valid for sidecars with the algorithm: leave it
                self._error(str(e))
                self._count(misses=1)
                return None
            self._call(lambda: self._client.delete(self.prefix + key), 0)
            self._count(misses=1, **{e.reason: 1})
            return None
        self._count(hits=1, bytes_read=payload.nbytes)
        return payload

    # ---- writes -------------------------------------------------------------------------------
    def set(self, key: bytes, data: Buffer) -> bool:
        return self.batch_set([(key, data)])[0]

    def batch_set(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        for key, data in items:  # validate everything before sending anything
            fmt.check_key(key)
            if memoryview(data).nbytes != self.identity.page_bytes:
                raise ValueError(
                    f"page payload must be {self.identity.page_bytes} bytes, got {memoryview(data).nbytes}"
                )
        ok: list[bool] = []
        for start in range(0, len(items), self._per_batch):
            chunk = items[start : start + self._per_batch]

            def run(chunk: Sequence[tuple[bytes, Buffer]] = chunk) -> list[bool]:
                pipe = self._client.pipeline(transaction=False)
                for key, data in chunk:
                    pipe.set(self.prefix + key, fmt.encode_page(self.identity, key, data), px=self.ttl_ms)
                replies = pipe.execute(raise_on_error=False)  # an error reply fails its page only
                errors = [r for r in replies if isinstance(r, Exception)]
                if errors:
                    self._error(f"redis {self.url}: {len(errors)} of {len(replies)} writes failed: {errors[0]}")
                return [not isinstance(r, Exception) and bool(r) for r in replies]

            results, _ = self._call(run, [False] * len(chunk))
            ok.extend(results)
        n_ok = sum(ok)
        self._count(writes=n_ok, bytes_written=n_ok * self.identity.page_bytes, write_failures=len(ok) - n_ok)
        return ok

    def delete(self, key: bytes) -> bool:
        q = self.qualified(key)
        removed, _ = self._call(lambda: self._client.delete(q), 0)
        if removed:
            self._count(deletes=1)
        return bool(removed)


def _wrong_type(reply: Any) -> bool:
    """A WRONGTYPE error reply: the key holds a list, hash, ... instead of a page."""
    from redis.exceptions import ResponseError

    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")
