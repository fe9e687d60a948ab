"""Copy grants: host pages handed to an engine that copies itself (copy path "engine").

Where the sidecar cannot map the engine's memory (a private allocation, a CuMem CUDA pool),
the engine maps the sidecar's host pool and copies between it and its own KV cache. The
sidecar still decides which host page holds which key: BeginCopy grants pages, EndCopy ends
the grant.

- An offload grant reserves host pages for the keys not yet held. They stay invisible
  (lookups miss, reloads skip them) until EndCopy commits them; an abort, or a grant that is
  never ended, gives them back with nothing published.
- A reload grant references the host pages of the longest loadable prefix (fetching from
  storage first), so nothing evicts or overwrites them while the engine reads; EndCopy
  drops the references.

A grant not ended within `ttl_s` (the pool's lease) is ended by expire(): an engine that
crashed mid-copy leaves no half-written page visible and no page held.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hicache.api import CopyGrant
from hicache.cache.results import Reservation
from hicache.cache.tiering import HierarchicalCache
from hicache.sidecar.errors import UnknownId
from hicache.sidecar.operations import offload_statuses, reload_statuses


@dataclass
class _Grant:
    offload: bool
    keys: list[bytes]  # the granted keys, in the order of their host pages
    expires: float
    reservation: Reservation | None = field(default=None, repr=False)  # offload grants


class CopyGrants:
    """One pool's open grants. Thread-safe; the cache does the index work under its own lock."""

    def __init__(self, cache: HierarchicalCache, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.cache = cache
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[str, _Grant] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def offload(self, keys: list[bytes]) -> CopyGrant:
        """Reserve host pages for the keys not held yet: STORED (granted: copy it into its
        page, then commit), DEDUPLICATED (held or being filled), NO_SPACE (no room)."""
        res = self.cache.reserve(keys, partial=True)
        assert res is not None
        statuses = offload_statuses(res, keys)
        if not res.new:
            self.cache.abort(res)  # nothing reserved: nothing to keep open
            return CopyGrant(statuses, (), "", 0.0)
        grant = _Grant(True, [k for k, _ in res.new], self._clock() + self.ttl_s, res)
        return CopyGrant(statuses, tuple(p for _, p in res.new), self._add(grant), self.ttl_s)

    def reload(self, keys: list[bytes]) -> CopyGrant:
        """Reference the host pages of the longest loadable prefix of `keys` (storage-only
        keys are fetched into host first): LOADED / LOADED_FROM_STORAGE, then NOT_FOUND from
        the first gap on. The engine copies each granted page from its host page."""
        loaded = self.cache.load(keys)
        statuses = reload_statuses(loaded, len(keys))
        if not loaded.keys:
            return CopyGrant(statuses, (), "", 0.0)
        grant = _Grant(False, list(loaded.keys), self._clock() + self.ttl_s)
        return CopyGrant(statuses, tuple(loaded.pages), self._add(grant), self.ttl_s)

    def _add(self, grant: _Grant) -> str:
        grant_id = "grant-" + secrets.token_hex(8)
        with self._lock:
            self._open[grant_id] = grant
        return grant_id

    def end(self, grant_id: str, commit: bool) -> tuple[bool, int]:
        """End a grant: an offload's pages are published (commit) or given back; a reload's
        references are dropped (commit says whether the engine's copy succeeded, for the
        counters). Returns (offload, pages). Raises UnknownId for a grant that is unknown,
        already ended or expired (an expired offload published nothing)."""
        with self._lock:
            grant = self._open.pop(grant_id, None)
        if grant is None:
            raise UnknownId(f"copy grant {grant_id!r} is unknown, already ended or expired")
        self._finish(grant, commit)
        return grant.offload, len(grant.keys)

    def _finish(self, grant: _Grant, commit: bool) -> None:
        if grant.reservation is None:
            self.cache.release(grant.keys)
        elif commit:
            self.cache.commit(grant.reservation)
        else:
            self.cache.abort(grant.reservation)

    def extend(self, seconds: float) -> None:
        """Give every open grant `seconds` more (the sidecar was not running meanwhile)."""
        with self._lock:
            for grant in self._open.values():
                grant.expires += seconds

    def expire(self) -> int:
        """End every grant past its time, as failed; returns how many."""
        now = self._clock()
        with self._lock:
            late = [gid for gid, g in self._open.items() if g.expires <= now]
            grants = [self._open.pop(gid) for gid in late]
        for grant in grants:
            self._finish(grant, False)
        return len(grants)

    def close(self) -> None:
        """End every open grant as failed (the pool is closing)."""
        with self._lock:
            grants, self._open = list(self._open.values()), {}
        for grant in grants:
            self._finish(grant, False)
