"""The storage tier interface: flat page bytes under page keys, below the host pool.

A tier stores pages of one identity: a geometry (fingerprint and page_bytes), a model
(name + revision) and a namespace (tenant). Every stored key is qualified by all three,
and every stored page carries them in its header (see page_format), so a page of another
geometry, model or tenant is never a hit. Tiers are thread-safe.

Failure policy: a tier never raises for a storage-side problem (disk full, Redis down,
a corrupt page). Reads become misses, writes return False, and the event is counted in
stats(). Caller mistakes (a malformed key, a payload of the wrong size) raise ValueError.
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hicache.geometry import KVGeometry
from hicache.validate import is_int

Buffer = bytes | bytearray | memoryview
# A page's payload as a tier stores it: one buffer, or a list of buffers whose concatenation
# is the page (a host page's pieces, HostKVPool.page_pieces), stored without joining them.
Payload = Buffer | list[Buffer]


@dataclass(frozen=True)
class TierIdentity:
    """Who a stored page belongs to. Raises ValueError for a bad field."""

    fingerprint: str  # KVGeometry.fingerprint: 16 hex digits
    page_bytes: int  # KVGeometry.page_bytes: every payload is exactly this long
    model_id: str  # model name + revision, e.g. "deepseek-ai/DeepSeek-V3@main"
    namespace: str = ""  # tenant / cache salt
    # the tier secret: pages carry its MAC (page_format); b"" for none. Never in a repr or log.
    secret: bytes = field(default=b"", repr=False)
    model_hash: bytes = field(init=False, repr=False)
    namespace_hash: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            ok = isinstance(self.fingerprint, str) and len(bytes.fromhex(self.fingerprint)) == 8
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"fingerprint must be 16 hex digits, got {self.fingerprint!r}")
        if not is_int(self.page_bytes) or self.page_bytes < 1:
            raise ValueError(f"page_bytes must be an int >= 1, got {self.page_bytes!r}")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"model_id must be a non-empty str (name + revision), got {self.model_id!r}")
        if not isinstance(self.namespace, str):
            raise ValueError(f"namespace must be a str, got {self.namespace!r}")
        if not isinstance(self.secret, bytes):
            raise ValueError(f"the tier secret must be bytes, got a {type(self.secret).__name__}")
        object.__setattr__(self, "model_hash", hashlib.sha256(self.model_id.encode()).digest()[:8])
        object.__setattr__(self, "namespace_hash", hashlib.sha256(self.namespace.encode()).digest()[:8])

    @classmethod
    def for_geometry(
        cls, geometry: KVGeometry, model_id: str, namespace: str = "", secret: bytes = b""
    ) -> TierIdentity:
        return cls(geometry.fingerprint, geometry.page_bytes, model_id, namespace, secret)

    @property
    def fingerprint_bytes(self) -> bytes:
        return bytes.fromhex(self.fingerprint)

    @property
    def qualifier(self) -> str:
        """ "<namespace hash>-<fingerprint>-<model hash>": the prefix of every stored key."""
        return f"{self.namespace_hash.hex()}-{self.fingerprint}-{self.model_hash.hex()}"


@dataclass
class TierStats:
    """Counters of one tier. `pages`/`bytes` are None when the backend cannot tell cheaply."""

    backend: str = ""
    healthy: bool = True
    pages: int | None = None
    bytes: int | None = None
    capacity_bytes: int | None = None  # the size cap, when the tier has one
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_failures: int = 0  # includes no_space
    no_space: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt: int = 0  # failed magic/length/checksum: deleted, served as a miss
    foreign: int = 0  # another geometry/model/namespace/key: deleted, served as a miss
    forged: int = 0  # with a tier secret, no valid MAC: deleted, served as a miss
    evictions: int = 0
    deletes: int = 0
    errors: int = 0  # backend errors (I/O, connection, timeout)
    last_error: str = ""
    nodes_down: list[str] = field(default_factory=list)  # servers (cluster nodes) down now

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TierHealth:
    healthy: bool
    detail: str = ""


class StorageTier(ABC):
    """Pages of one TierIdentity, keyed by page keys (bytes of length 1..64).

    Subclasses implement the single-key methods and may override the batch ones.
    """

    backend = "abstract"
    enabled = True  # False for the null tier: nothing is ever stored
    # True where the backend may drop keys without the tier seeing it (a Redis TTL or
    # maxmemory eviction): a key read from it earlier is then not known to be there still.
    forgets_on_its_own = False

    def __init__(self, identity: TierIdentity):
        self.identity = identity
        self._stats_lock = threading.Lock()
        self._counters = TierStats(backend=self.backend)
        self._watchers: tuple[Callable[[str, list[bytes]], None], ...] = ()

    # ---- the interface -----------------------------------------------------------------------
    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether a page for `key` is (believed) stored; a later get() may still miss."""

    @abstractmethod
    def get(self, key: bytes) -> memoryview | None:
        """The payload (identity.page_bytes) stored under `key`, or None for a miss. A page
        that fails verification is deleted, counted, and returned as None."""

    @abstractmethod
    def set(self, key: bytes, data: Payload) -> bool:
        """Store `data` (one buffer, or a list of buffers in page order) under `key`; True
        once acknowledged (readable, and on the file tier with fsync durable). False on a storage
        failure or no space. Raises ValueError if `data` is not identity.page_bytes long in
        all or the key is malformed."""

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove `key`; True if something was removed."""

    @abstractmethod
    def health(self) -> TierHealth:
        """Whether the tier can serve now (the Redis tier probes a down server here)."""

    def close(self) -> None:  # noqa: B027 - optional for a tier
        """Release resources. The tier is unusable afterwards."""

    def check_integrity(self) -> None:  # noqa: B027 - optional for a tier
        """Assert internal invariants (tests call this)."""

    # ---- batch forms (override for round-trip savings) ---------------------------------------
    def exists(self, key: bytes) -> bool:
        return self.contains(key)

    def batch_contains(self, keys: Sequence[bytes]) -> list[bool]:
        """contains() for each key."""
        return [self.contains(k) for k in keys]

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of `keys` that is stored."""
        n = 0
        for present in self.batch_contains(keys):
            if not present:
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        return [self.get(k) for k in keys]

    def batch_set(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]:
        return [self.set(k, d) for k, d in items]

    def batch_read(self, keys: Sequence[bytes], sink: Callable[[int, memoryview], None]) -> int:
        """Read the longest stored prefix of `keys`, calling sink(i, payload) for each in
        order; the payload is valid only during the call (a tier may read into a buffer it
        reuses: no allocation per page). Returns how many were read (stops at the first miss)."""
        n = 0
        for payload in self.batch_get(keys):
            if payload is None:
                break
            sink(n, payload)
            n += 1
        return n

    def batch_read_into(self, keys: Sequence[bytes], pieces_of: Callable[[int], Sequence[memoryview]]) -> int:
        """batch_read, with page i's payload landing in pieces_of(i): writable byte views
        whose lengths add up to page_bytes, filled in order (a host page's chunks). A tier
        that can read straight into them does (FileTier); this one copies each payload.
        Returns how many were read; the pieces of the page that stopped it may hold any
        bytes. Raises ValueError if the pieces do not add up to page_bytes."""

        def sink(i: int, payload: memoryview) -> None:
            at = 0
            for piece in check_pieces(pieces_of(i), self.identity.page_bytes):
                piece.cast("B")[:] = payload[at : at + piece.nbytes]
                at += piece.nbytes

        return self.batch_read(keys, sink)

    def stats(self) -> TierStats:
        """A snapshot of the counters (a copy)."""
        with self._stats_lock:
            snap = replace(self._counters, nodes_down=[])
        snap.healthy = self.health().healthy
        self._fill_stats(snap)
        return snap

    # ---- watchers (KV events) ------------------------------------------------------------------
    def add_watcher(self, watcher: Callable[[str, list[bytes]], None]) -> None:
        """Call watcher("stored" | "removed", keys) after pages are written or leave the tier
        (deleted, evicted by its cap, found corrupt). It must only record, never block. A
        tier does not see what its backend drops by itself (a Redis TTL or maxmemory)."""
        with self._stats_lock:
            self._watchers = (*self._watchers, watcher)

    def remove_watcher(self, watcher: Callable[[str, list[bytes]], None]) -> None:
        """Stop calling `watcher`: any watcher equal to it (obj.method is a new bound method
        on each access, equal to the one added, not the same object)."""
        with self._stats_lock:
            self._watchers = tuple(w for w in self._watchers if w != watcher)

    def _changed(self, change: str, keys: list[bytes]) -> None:
        if keys:
            for watcher in self._watchers:
                watcher(change, keys)

    # ---- helpers for subclasses -------------------------------------------------------------
    def _fill_stats(self, snap: TierStats) -> None:  # noqa: B027 - optional for a tier
        """Set backend-specific fields (pages, bytes) on a snapshot."""

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)

    def _error(self, message: str) -> None:
        with self._stats_lock:
            self._counters.errors += 1
            self._counters.last_error = message


def skip_done(views: list[memoryview], at: int, done: int) -> int:
    """After a gathered write (writev, sendmsg) from views[at:] that moved `done` bytes: the
    index of the first view not wholly written, views[at] trimmed to its unwritten rest."""
    while at < len(views) and done >= views[at].nbytes:
        done -= views[at].nbytes
        at += 1
    if done:
        views[at] = views[at][done:]
    return at


def check_pieces(pieces: Sequence[memoryview], page_bytes: int) -> Sequence[memoryview]:
    """`pieces` if they are writable byte views adding up to page_bytes; else ValueError."""
    total = 0
    for piece in pieces:
        if piece.readonly or piece.itemsize != 1 or not piece.c_contiguous:
            raise ValueError(f"a page piece must be a writable contiguous byte view, got {piece!r}")
        total += piece.nbytes
    if total != page_bytes:
        raise ValueError(f"page pieces add up to {total} bytes, not the page's {page_bytes}")
    return pieces
