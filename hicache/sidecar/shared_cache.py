"""One host cache per node and model: the host pool, its index and its storage tier, shared by
every registered pool (engine, rank) of the same identity.

A registration whose CacheIdentity matches a live cache joins it: it gets its own pool id,
secret, lease, device mapping, transfer engine, copy grants and pins (RegisteredPool), and
every member sees the pages any member offloaded. The rules:
- the host budget counts a cache once (its weight: the largest member's device pool);
- a member's pins, references and grants are its own: leaving releases only those;
- KV events fan out: each member publishes the cache's host and storage changes under its
  own pool id, so a router sees every engine that can serve a page;
- the cache closes with its last member (its pages outlive an engine that restarts while
  another member holds it).
A pool without a model id never shares: two unnamed models of one shape would read each
other's pages under equal keys.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from hicache.sidecar.errors import StateError

if TYPE_CHECKING:  # torch: the service loads it with the first pool
    from hicache.cache.tiering import HierarchicalCache
    from hicache.geometry import KVGeometry
    from hicache.pools import HostKVPool
    from hicache.sidecar.events import PoolEvents
    from hicache.sidecar.registration import PoolRequest


@dataclass(frozen=True)
class CacheIdentity:
    """What two registrations must share to share a host cache."""

    namespace: str
    stored_model_id: str  # the model, its revision and the rank's TP slice
    group: str
    geometry: str  # KVGeometry.fingerprint (layers, heads, head dims, dtype, page size)
    key_hash: str

    @classmethod
    def of(cls, req: PoolRequest) -> CacheIdentity | None:
        """The identity `req` shares under; None for a pool without a model id (never shared)."""
        if not req.model_id:
            return None
        return cls(req.namespace, req.stored_model_id, req.group, req.geometry.fingerprint, req.key_hash)


class SharedHostCache:
    """Thread-safe. Members join and leave under the service's space lock; the last to leave
    closes the cache (leave() says so; the caller then calls close())."""

    def __init__(self, identity: CacheIdentity | None, cache: HierarchicalCache, namespace: str = ""):
        self.identity = identity
        self.namespace = namespace  # the tenant its host budget share counts against
        self.cache = cache
        self.host = cast("HostKVPool", cache.pool)  # a HostKVPool: the sidecar's caches are over one
        self.cache_id = "cache-" + secrets.token_hex(6)
        # the host pages it grows to in the background (sidecar.host_growth): its share of the budget
        self.host_goal = self.host.num_pages
        self._lock = threading.Lock()  # guards the members, the closing flag and resizes
        self._members: dict[str, int] = {}  # pool id -> its device pool's bytes (its budget weight)
        self._events: tuple[PoolEvents, ...] = ()  # read without the lock by the index observer
        self.closing = False
        cache.index.observer = self._host_changed

    @property
    def geometry(self) -> KVGeometry:
        return self.cache.geometry

    @property
    def members(self) -> int:
        with self._lock:
            return len(self._members)

    @property
    def device_bytes(self) -> int:
        """Its weight in the host budget: the largest member's device pool (1 once empty)."""
        with self._lock:
            return max(self._members.values(), default=1)

    @property
    def host_pages(self) -> int:
        """Host pages usable now (a shared host budget moves it; see resize_host)."""
        return self.cache.index.limit

    # ---- members -------------------------------------------------------------------------------
    def join(self, pool_id: str, device_bytes: int, events: PoolEvents | None) -> bool:
        """Add a member; False (nothing changed) once the cache is closing."""
        with self._lock:
            if self.closing:
                return False
            self._members[pool_id] = device_bytes
            if events is not None:
                self.cache.storage.add_watcher(events.storage)
                self._events = (*self._events, events)
        if events is not None:
            events.registered(self.cache.with_host_keys)
        return True

    def leave(self, pool_id: str, events: PoolEvents | None, closing: Callable[[], None]) -> None:
        """Remove a member. The last one closes the cache: closing() runs first (the member's
        own teardown), then the cache's queued storage writes finish (their events still go
        to the last member's subscribers) before the host pool and the tier are released."""
        with self._lock:
            self._members.pop(pool_id, None)
            last = not self._members
            self.closing = self.closing or last
        if not last:
            self._detach(events)
            closing()
            return
        with contextlib.ExitStack() as steps:  # each runs, in reverse order, whatever an earlier one raised
            steps.callback(self.host.close)
            steps.callback(self.cache.storage.close)
            steps.callback(self._detach, events)
            steps.callback(self.cache.close)
            steps.callback(closing)

    def _detach(self, events: PoolEvents | None) -> None:
        if events is None:
            return
        with self._lock:
            self._events = tuple(e for e in self._events if e is not events)
        self.cache.storage.remove_watcher(events.storage)
        events.unregistered()

    def _host_changed(self, change: str, keys: list[bytes]) -> None:
        """The host index's observer (under the cache lock): every member publishes it."""
        for events in self._events:
            events.host(change, keys)

    # ---- the host budget -------------------------------------------------------------------
    def resize_host(self, pages: int) -> None:
        """Use `pages` host pages (at most the segment): growing commits their memory first
        (OSError ENOSPC if it does not fit, nothing changed); shrinking evicts what lies above
        and gives its memory back (on CPU). StateError once the cache is closing."""
        with self._lock:
            if self.closing:
                raise StateError(f"host cache {self.cache_id} is closing")
            old = self.cache.index.limit
            if pages > old:
                self.host.commit_pages(old, min(pages, self.host.num_pages))
            self.host.release_pages(self.cache.resize_host(pages))
