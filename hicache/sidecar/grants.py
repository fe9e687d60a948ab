"""Copy grants: host pages handed to an engine that copies itself (copy path "engine").

Where the sidecar cannot map the engine's memory (a private allocation, a CuMem CUDA pool),
the engine copies between its own KV cache and the sidecar. The sidecar still decides which
host page holds which key: BeginCopy grants pages, EndCopy ends the grant.

- The engine maps the host pool for reading only. It writes an offload into the pool's copy
  window instead: a small shared segment of its own (window_pages pages, in the host pool's
  layout), whose slots an offload grant hands out. EndCopy(commit) copies the slots into the
  host pages reserved for the keys, then publishes them. So no engine can write a host page
  that other members read (a shared host cache), and a late write lands in its own window.
- An offload grant reserves host pages for the keys not yet held. They stay invisible
  (lookups miss, reloads skip them) until EndCopy commits them; an abort gives them back with
  nothing published.
- A reload grant references the host pages of the longest loadable prefix (fetching from
  storage first), so nothing evicts or overwrites them while the engine reads; EndCopy
  drops the references.

A grant holds its host pages and window slots until EndCopy, an abort, or its pool's release
(an engine that crashed mid-copy loses its pool with its lease): a copy that outlives the
lease while the engine lives (a paused process, a huge batch) never finds its pages reused.
A grant past `ttl_s` is only reported (expire() counts it, once, and logs it).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from hicache.api import CopyGrant, KeyStatus
from hicache.cache.offload import ROOM_WAIT_S
from hicache.cache.results import Reservation
from hicache.cache.tiering import HierarchicalCache
from hicache.sidecar.errors import UnknownId
from hicache.sidecar.operations import offload_statuses, reload_statuses

if TYPE_CHECKING:  # torch: the service loads it with the first pool
    from hicache.pools import HostKVPool

log = logging.getLogger("hicache.sidecar.service")

WINDOW_BYTES = 32 << 20  # an engine-copy pool's copy window (at least one page)
MAPPED_WINDOW_BYTES = 4 << 20  # a pool the sidecar maps: BeginCopy is its rare path (SGLang's flat pages)


def window_pages(page_bytes: int, device_pages: int, *, engine_copies: bool) -> int:
    """The pages of the copy window of a pool of device_pages pages of page_bytes each."""
    nbytes = WINDOW_BYTES if engine_copies else MAPPED_WINDOW_BYTES
    return max(1, min(device_pages, nbytes // page_bytes))


@dataclass
class _Grant:
    offload: bool
    keys: list[bytes]  # the granted keys, in the order of their host pages
    expires: float
    reservation: Reservation | None = field(default=None, repr=False)  # offload grants
    slots: list[int] = field(default_factory=list)  # offload grants: their window slots, in key order
    overdue: bool = False  # reported past its time


class CopyGrants:
    """One pool's open grants. Thread-safe; the cache does the index work under its own lock.
    `window`: the pool's copy window (offload grants hand out its pages), owned and closed
    here; None for a pool built without one (offload grants are refused)."""

    def __init__(
        self,
        cache: HierarchicalCache,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        window: HostKVPool | None = None,
    ):
        self.cache = cache
        self.ttl_s = ttl_s
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[str, _Grant] = {}
        self._free_slots = list(range(window.num_pages))[::-1] if window is not None else []
        self.overdue = 0  # grants reported past their time, ever

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def offload(self, keys: list[bytes]) -> CopyGrant:
        """Reserve host pages for the keys not held yet: STORED (granted: copy it into the
        window slot the grant names, then commit), DEDUPLICATED (held or being filled),
        NO_SPACE (no room in the host cache, or no free window slot). Host pages that wait
        for their storage writes are waited for first (ROOM_WAIT_S at most). Raises
        ValueError for a pool without a window, or more keys than the window holds."""
        if self.window is None:
            raise ValueError("this pool has no copy window: offload it with Offload, not BeginCopy")
        if len(keys) > self.window.num_pages:
            raise ValueError(
                f"{len(keys)} keys in one offload grant, but the copy window holds {self.window.num_pages} pages: "
                "split the offload"
            )
        self.cache.wait_for_room_for(keys, ROOM_WAIT_S)  # host pages waiting for their storage writes
        res = self.cache.reserve(keys, partial=True)
        assert res is not None
        statuses = offload_statuses(res, keys)
        with self._lock:
            slots = [self._free_slots.pop() for _ in res.new] if len(self._free_slots) >= len(res.new) else None
        if not res.new or slots is None:
            self.cache.abort(res)  # nothing reserved, or no window room: nothing to keep open
            full = tuple(KeyStatus.NO_SPACE if s == KeyStatus.STORED else s for s in statuses)
            return CopyGrant(full, (), "", 0.0)
        grant = _Grant(True, [k for k, _ in res.new], self._clock() + self.ttl_s, res, slots)
        return CopyGrant(statuses, tuple(slots), self._add(grant), self.ttl_s)

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
        """End a grant: an offload's window slots are copied into its host pages, which are
        then published (commit), or given back; a reload's references are dropped (commit
        says whether the engine's copy succeeded, for the counters). Returns (offload, pages).
        Raises UnknownId for a grant that is unknown, already ended, or ended with its pool."""
        with self._lock:
            grant = self._open.pop(grant_id, None)
        if grant is None:
            raise UnknownId(f"copy grant {grant_id!r} is unknown or already ended")
        self._finish(grant, commit)
        return grant.offload, len(grant.keys)

    def _finish(self, grant: _Grant, commit: bool) -> None:
        try:
            if grant.reservation is None:
                self.cache.release(grant.keys)
            elif commit:
                assert self.window is not None
                try:
                    cast("HostKVPool", self.cache.pool).copy_pages_from(
                        self.window, grant.slots, [p for _, p in grant.reservation.new]
                    )
                except BaseException:
                    self.cache.abort(grant.reservation)
                    raise
                self.cache.commit(grant.reservation)
            else:
                self.cache.abort(grant.reservation)
        finally:
            with self._lock:
                self._free_slots.extend(grant.slots)

    def extend(self, seconds: float) -> None:
        """Give every open grant `seconds` more (the sidecar was not running meanwhile)."""
        with self._lock:
            for grant in self._open.values():
                grant.expires += seconds

    def expire(self) -> int:
        """Report the grants past their time (once each): they keep their pages and slots
        until EndCopy or the pool's release. Returns how many became overdue now."""
        now = self._clock()
        with self._lock:
            late = [(gid, g) for gid, g in self._open.items() if g.expires <= now and not g.overdue]
            for _, grant in late:
                grant.overdue = True
            self.overdue += len(late)
        for gid, grant in late:
            log.warning(
                "copy grant %s (%s of %d pages) is past its %.0f s: its pages stay held until EndCopy or the "
                "pool's release",
                gid,
                "offload" if grant.offload else "reload",
                len(grant.keys),
                self.ttl_s,
            )
        return len(late)

    def close(self) -> None:
        """End every open grant as failed and release the window (the pool is closing)."""
        with self._lock:
            grants, self._open = list(self._open.values()), {}
        try:
            for grant in grants:
                self._finish(grant, False)
        finally:
            if self.window is not None:
                self.window.close()
