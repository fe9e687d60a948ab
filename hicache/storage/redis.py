"""The Redis (or Valkey) tier: pages shared by every sidecar that points at one server, or
at one Redis Cluster (cluster=True; see redis_cluster_link).

Keys are b"hicache:<identity qualifier>:" + page key, values are pages in page_format.
Batches go through non-transactional pipelines (one per cluster master, in parallel).
When a server (a cluster node) is down or slow, each operation on it
returns a miss or a failure, the tier reports unhealthy, and it retries only after an
exponential backoff (backoff_initial_s doubling to backoff_max_s): in between,
calls return at once without touching the network, so a dead Redis costs the caller
nothing. The first successful call (or a health() probe after the backoff) makes the tier
healthy again. With ttl_s, pages expire ttl_s after their last write or read; a size cap
is Redis's own `maxmemory` with an LRU `maxmemory-policy`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicache.storage import page_format as fmt
from hicache.storage.base import Buffer, Payload, StorageTier, TierHealth, TierIdentity, TierStats
from hicache.storage.lazy_threads import LazyThreads
from hicache.storage.redis_link import Backoff, Command, Link, ServerLink, down_errors
from hicache.storage.redis_options import check_options
from hicache.storage.resp import Into, Parts

# A batch's pages are checksummed before any is sent; those of PARALLEL_HASH_BYTES or more
# (where a thread hand-off costs far less than the hash) on HASH_THREADS threads at once.
HASH_THREADS = 2
PARALLEL_HASH_BYTES = 1 << 20

# Deletes KEYS[1] only while it still holds what a read found wrong there, so that a page
# another sidecar stored in between is kept. ARGV[1] says what was found: "type" (a value
# that is not a string), "length" (a string of ARGV[2] bytes) or "value" (the value ARGV[2],
# sent back whole: only a full compare tells a damaged page from a fresh write of the same
# page, whose header is the same; it happens only for a page that failed verification).
DROP_UNCHANGED = """
local found = redis.call('TYPE', KEYS[1])['ok']
local same
if ARGV[1] == 'type' then
    same = found ~= 'string' and found ~= 'none'
elseif found ~= 'string' then
    same = false
elseif ARGV[1] == 'length' then
    same = redis.call('STRLEN', KEYS[1]) == tonumber(ARGV[2])
else
    same = redis.call('GET', KEYS[1]) == ARGV[2]
end
if same then
    return redis.call('DEL', KEYS[1])
end
return 0
"""
Found = tuple[bytes, str, Any]  # (Redis key, what was found there, its length or value): see DROP_UNCHANGED


class RedisTier(StorageTier):
    """Pages of `identity` in the Redis server at `url` ("redis://host:port/db" or
    "unix:///path/to.sock"), or with cluster=True in the Redis Cluster that the startup
    node(s) in `url` (a URL, a comma-separated string or a list) belong to. Needs the
    `redis` package (ImportError otherwise).

    Raises ValueError for a bad url, timeout_s, ttl_s or backoff. Does not connect in the
    constructor: an unreachable server makes the tier unhealthy, not the constructor fail.
    """

    backend = "redis"
    forgets_on_its_own = True  # a TTL, or maxmemory with an LRU policy, drops keys unannounced

    def __init__(
        self,
        identity: TierIdentity,
        url: str | Sequence[str],
        *,
        cluster: bool = False,
        timeout_s: float = 1.0,
        ttl_s: float | None = None,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 10.0,
        max_batch_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(identity)
        check_options(url, timeout_s, ttl_s, backoff_initial_s, backoff_max_s, cluster)
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))

        def backoff() -> Backoff:
            return Backoff(backoff_initial_s, backoff_max_s, clock)

        self._link: Link
        if cluster:
            from hicache.storage.redis_cluster_link import ClusterLink

            self._link = ClusterLink(url, timeout_s, backoff, self._error, clock)
        else:
            assert isinstance(url, str)
            self._link = ServerLink(url, timeout_s, backoff(), self._error)
        self.url = self._link.url
        self._down = down_errors()
        self.prefix = f"hicache:{identity.qualifier}:".encode()
        self._per_batch = max(1, max_batch_bytes // fmt.stored_size(identity, b"k" * 32))
        self._arenas = threading.local()  # each thread's reused buffer that GET replies land in
        self._hashers = LazyThreads(HASH_THREADS, "hicache-redis-hash")
        self._closed = False

    def qualified(self, key: bytes) -> bytes:
        """The Redis key of page key `key`."""
        fmt.check_key(key)
        return self.prefix + key

    def health(self) -> TierHealth:
        if self._closed:  # no probe: it would open a new connection after close()
            return TierHealth(False, f"redis tier {self.url}: closed")
        return self._link.health()

    def nodes_down(self) -> list[str]:
        """The servers (cluster nodes) that are down now, host:port."""
        return [] if self._closed else self._link.nodes_down()

    def _fill_stats(self, snap: TierStats) -> None:
        snap.nodes_down = self.nodes_down()

    def close(self) -> None:
        self._closed = True
        self._link.close()
        self._hashers.close()

    # ---- reads --------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.batch_contains([key])[0]

    def batch_contains(self, keys: Sequence[bytes]) -> list[bool]:
        qkeys = [self.qualified(k) for k in keys]
        # STRLEN: 0 when absent; WRONGTYPE for a value that is not a string
        replies = self._link.run([("STRLEN", q) for q in qkeys])
        out: list[bool] = []
        bad: list[Found] = []
        for key, q, n in zip(keys, qkeys, replies, strict=True):
            size = fmt.stored_size(self.identity, key)
            # what Reload would refuse: gone now, so that Lookup and Reload agree
            if _wrong_type(n):
                bad.append((q, "type", ""))
            elif isinstance(n, int) and n not in (0, size):
                bad.append((q, "length", n))
            out.append(isinstance(n, int) and n == size)
        self._count(corrupt=len(bad))
        self._drop_unchanged(bad)
        return out

    def _drop_unchanged(self, found: list[Found]) -> None:
        """Delete what was found under our page keys that is not a page of ours (another type,
        another size, a value that failed verification), each only while its key still holds
        it (DROP_UNCHANGED): a page stored since by another sidecar is kept."""
        if not found:
            return
        replies = self._link.run([("EVAL", DROP_UNCHANGED, 1, q, what, seen) for q, what, seen in found])
        self._note_errors(replies, "deletes")
        gone = [q for (q, _, _), removed in zip(found, replies, strict=True) if removed == 1]
        self._changed("removed", [q[len(self.prefix) :] for q in gone])

    def get(self, key: bytes) -> memoryview | None:
        return self.batch_get([key])[0]

    def batch_get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        for start in range(0, len(keys), self._per_batch):
            out.extend(self._get_chunk(keys[start : start + self._per_batch], None))
        return out

    def batch_read(self, keys: Sequence[bytes], sink: Callable[[int, memoryview], None]) -> int:
        """batch_get's prefix, each page received straight into this thread's reused buffer
        (resp: no allocation and no copy between the socket and the checksum), then handed
        to sink."""
        n = 0
        for start in range(0, len(keys), self._per_batch):
            chunk = keys[start : start + self._per_batch]
            for payload in self._get_chunk(chunk, self._arena_slots(chunk)):
                if payload is None:
                    return n
                sink(n, payload)
                n += 1
        return n

    def _arena_slots(self, keys: Sequence[bytes]) -> Into:
        """into() giving GET reply i its stored size's slot of this thread's reused buffer
        (None, a new buffer, for a reply of another size: it is refused as corrupt anyway)."""
        sizes = [fmt.stored_size(self.identity, key) for key in keys]
        arena = getattr(self._arenas, "buffer", None)
        if arena is None or len(arena) < sum(sizes):
            arena = self._arenas.buffer = bytearray(sum(sizes))
        whole, starts, offset = memoryview(arena), [], 0
        for size in sizes:
            starts.append(offset)
            offset += size

        def into(i: int, size: int) -> memoryview | None:
            return whole[starts[i] : starts[i] + size] if size == sizes[i] else None

        return into

    def _get_chunk(self, keys: Sequence[bytes], into: Into | None) -> list[memoryview | None]:
        qkeys = [self.qualified(k) for k in keys]
        read: Command = ("GET",) if self.ttl_ms is None else ("GETEX",)
        tail: tuple[Any, ...] = () if self.ttl_ms is None else ("PX", self.ttl_ms)
        blobs = self._link.run([(*read, q, *tail) for q in qkeys], into)
        self._note_errors(blobs, "reads")
        out: list[memoryview | None] = []
        wrong: list[Found] = []
        for key, q, blob in zip(keys, qkeys, blobs, strict=True):
            if _wrong_type(blob):
                wrong.append((q, "type", ""))
                out.append(None)
            else:
                out.append(self._decode(key, None if isinstance(blob, Exception) else blob))
        self._count(misses=len(wrong), corrupt=len(wrong))
        self._drop_unchanged(wrong)
        return out

    def _decode(self, key: bytes, blob: Buffer | None) -> memoryview | None:
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
            self._count(misses=1, **{e.reason: 1})
            self._drop_unchanged([(self.prefix + key, "value", blob)])
            return None
        self._count(hits=1, bytes_read=payload.nbytes)
        return payload

    # ---- writes -------------------------------------------------------------------------------
    def set(self, key: bytes, data: Payload) -> bool:
        return self.batch_set([(key, data)])[0]

    def batch_set(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]:
        encoded = self._encode_all(items)  # checks every page before sending any
        tail: tuple[Any, ...] = () if self.ttl_ms is None else ("PX", self.ttl_ms)
        ok: list[bool] = []
        for start in range(0, len(items), self._per_batch):
            chunk = items[start : start + self._per_batch]
            values = encoded[start : start + self._per_batch]
            replies = self._link.run(
                [("SET", self.prefix + key, value, *tail) for (key, _), value in zip(chunk, values, strict=True)]
            )
            self._note_errors(replies, "writes")
            done = [not isinstance(r, Exception) and bool(r) for r in replies]
            self._changed("stored", [key for (key, _), good in zip(chunk, done, strict=True) if good])
            ok.extend(done)
        n_ok = sum(ok)
        self._count(writes=n_ok, bytes_written=n_ok * self.identity.page_bytes, write_failures=len(ok) - n_ok)
        return ok

    def _encode_all(self, items: Sequence[tuple[bytes, Payload]]) -> list[Parts]:
        """Every page's stored form; pages of PARALLEL_HASH_BYTES or more on HASH_THREADS
        threads at once where the checksum runs without the GIL (the wire is idle meanwhile)."""
        if len(items) < 2 or self.identity.page_bytes < PARALLEL_HASH_BYTES or not fmt.hashes_without_gil():
            return [self._encode(key, data) for key, data in items]
        keys, payloads = zip(*items, strict=True)
        return list(self._hashers.get().map(self._encode, keys, payloads))  # the first error raises here

    def _encode(self, key: bytes, data: Payload) -> Parts:
        """The stored form of a page as buffers sent back to back: header + key, then the
        caller's payload itself, one buffer or its pieces (resp sends them as they are: no
        copy). Raises ValueError for a bad key or payload length (encode_header)."""
        return Parts((fmt.encode_header(self.identity, key, data), *fmt.payload_parts(data)))

    def _note_errors(self, replies: list[Any], what: str) -> None:
        """Count error replies (OOM under maxmemory, a redirect a plain client cannot follow)
        once per batch; the link has already counted servers that did not answer."""
        errors = [r for r in replies if isinstance(r, Exception) and not isinstance(r, self._down)]
        errors = [r for r in errors if not _wrong_type(r)]
        if errors:
            self._error(f"redis {self.url}: {len(errors)} of {len(replies)} {what} failed: {errors[0]}")

    def delete(self, key: bytes) -> bool:
        (removed,) = self._link.run([("DEL", self.qualified(key))])
        if isinstance(removed, int) and removed:
            self._count(deletes=1)
            self._changed("removed", [key])
            return True
        return False


def _wrong_type(reply: Any) -> bool:
    """A WRONGTYPE error reply: the key holds a list, hash, ... instead of a page."""
    from redis.exceptions import ResponseError

    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")
