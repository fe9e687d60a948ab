"""One registered pool on the sidecar: the engine's mapped device pool, its share of a host
cache (hicache.sidecar.shared_cache: the host mirror, its index and storage tier, shared by
every pool of one model and rank slice) and the transfers between them. Validates everything
before changing state. Its state and checks are in pool_state.py, offloads and copy grants
in pool_offload.py, reloads in pool_reload.py; here are its index calls, stats and close.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence

from hicache.api import (
    EvictResult,
    KeyStatus,
    LookupResult,
    PoolStats,
    PrefetchOutcome,
    Tier,
)
from hicache.cache.prefetch import PrefetchHandle
from hicache.sidecar.errors import QuotaExceeded
from hicache.sidecar.operations import (
    Operation,
    prefetch_statuses,
)
from hicache.sidecar.pool_offload import PoolOffloads
from hicache.sidecar.pool_reload import PoolReloads
from hicache.sidecar.pool_stats import pool_stats
from hicache.validate import is_int


class RegisteredPool(PoolOffloads, PoolReloads):
    """Thread-safe. The HierarchicalCache guards the host index and the storage tier; this
    object's lock guards only counters, operations, its pins and the closed flag, so copies
    run without it: an offload fills host pages reserved for it alone, and a reload reads
    host pages it holds references on, so nothing can evict or overwrite them meanwhile.
    """

    # ---- index operations -------------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes], policy: str | None = None) -> PrefetchOutcome:
        """Fetch from storage into host the keys after the host-resident prefix that form a
        prefix present in storage. best_effort answers at once (FETCHING keys; Watch the op
        for progress); wait_complete waits for the end; timeout waits up to its allowance and
        cancels the rest. Per key: RESIDENT (on host already), FETCHING (by this or an earlier
        prefetch), FETCHED, NO_SPACE (in storage, but pinned or referenced pages fill the host
        pool), NOT_FOUND (in storage but not brought in: after a gap in the chain, or its
        fetch failed or was cancelled), MISSING (in no tier). Raises ValueError for a bad policy."""
        ks = self.check_keys(keys)
        with self._in_flight():
            return self._prefetch(ks, policy)

    def _prefetch(self, ks: list[bytes], policy: str | None) -> PrefetchOutcome:
        handle = self.cache.prefetch(ks, policy)
        with self.lock:
            op_id = self._prefetches.add(handle)
        timed_out = False
        if handle.policy != "best_effort":
            timed_out = handle.result().timed_out
        done = handle.wait(0)
        statuses = prefetch_statuses(handle, ks, self.cache.lookup(ks), done)
        return PrefetchOutcome(statuses, op_id, done, timed_out)

    def evict(self, keys: Sequence[bytes], num_pages: int) -> EvictResult:
        """Drop `keys` (EVICTED / NOT_FOUND / BUSY when pinned, being read or being written to
        storage), or, with no keys, free up to num_pages least recently used pages (write_back
        stores them first). Raises ValueError for both or neither."""
        ks = self.check_keys(keys)
        if not is_int(num_pages) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        if bool(ks) == bool(num_pages):
            raise ValueError(f"give either keys or num_pages, got {len(ks)} keys and num_pages={num_pages}")
        with self._in_flight():
            if not ks:
                return EvictResult((), self.cache.evict(num_pages))
            statuses = tuple(KeyStatus[s.upper()] for s in self.cache.drop(ks))
            return EvictResult(statuses, statuses.count(KeyStatus.EVICTED))

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Each key's tier, and the length of the prefix held by some tier (what a Reload can
        serve); the host-resident keys become most recently used."""
        ks = self.check_keys(keys)
        with self._in_flight():
            tiers = tuple(Tier(t) for t in self.cache.lookup(ks))
            self.cache.touch(ks)
        prefix = next((i for i, t in enumerate(tiers) if t == Tier.NONE), len(tiers))
        return LookupResult(prefix, tiers)

    def pin(self, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
        """Pin each resident key (PINNED, else NOT_FOUND). The pins are this pool's: other
        members of its host cache cannot unpin them, and they go when this pool does. Raises
        QuotaExceeded, pinning nothing, when this pool would pin more distinct pages than
        its max_pin_share of the cache's host pages while it shares the cache with another
        pool (alone, its pins crowd out nobody but itself: vLLM's connector pins what it is
        about to load)."""
        ks = self.check_keys(keys)
        with self._in_flight(), self._pin_lock:
            cap = max(1, int(self.max_pin_share * self.shared.host_pages))
            here = {k for k, there in zip(ks, self.cache.resident(ks), strict=True) if there}
            wanted = len(self._pins.keys() | here)
            if wanted > cap and self.shared.members > 1:
                raise QuotaExceeded(
                    f"pool {self.identity.pool_id} would pin {wanted} pages; one pool may pin {cap} of its host "
                    f"cache's {self.shared.host_pages} (--max-pin-share {self.max_pin_share:g})"
                )
            got = self.cache.pin_each(ks)
            self._pins.update(k for k, s in zip(ks, got, strict=True) if s == "pinned")
        return tuple(KeyStatus[s.upper()] for s in got)

    def unpin(self, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
        """Drop one of this pool's pins of each key: UNPINNED, NOT_PINNED (not pinned by this
        pool, whoever else did) or NOT_FOUND (not on host)."""
        ks = self.check_keys(keys)
        with self._in_flight(), self._pin_lock:
            left, mine = Counter(self._pins), []
            for k in ks:  # each listing of a key takes one of this pool's pins of it
                mine.append(left[k] > 0)
                left[k] -= 1
            ours = iter(self.cache.unpin_each([k for k, m in zip(ks, mine, strict=True) if m]))
            theirs = iter(self.cache.resident([k for k, m in zip(ks, mine, strict=True) if not m]))
            out = [next(ours) if m else "not_pinned" if next(theirs) else "not_found" for m in mine]
            self._pins.subtract(k for k, s in zip(ks, out, strict=True) if s == "unpinned")
            self._pins = +self._pins  # drop the keys at zero
        return tuple(KeyStatus[s.upper()] for s in out)

    def _unpin_all(self) -> None:
        """Drop every pin this pool still holds (it is leaving its host cache)."""
        with self._pin_lock:
            if self._pins:
                self.cache.unpin_each(list(self._pins.elements()))
            self._pins.clear()

    def operation(self, op_id: str) -> Operation | PrefetchHandle:
        """Raises KeyError for an unknown id."""
        with self.lock:
            handle = self._prefetches.find(op_id)
            return handle if handle is not None else self._ops.get(op_id)

    def stats(self) -> PoolStats:
        cs = self.cache.stats()
        with self.lock:
            in_flight = len(self._ops.in_flight()) + cs["prefetches_active"]
            return pool_stats(
                self.identity,
                self.cache,
                cs,
                self.counters,
                device_pages=self.device_pages,
                in_flight=in_flight + len(self.grants),
                copy_backend=self.engine.backend if self.engine is not None else "engine",
                copy_path=self.copy_path,
                cache_id=self.shared.cache_id,
                cache_members=self.shared.members,
            )

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def host_pages(self) -> int:
        """Host pages its cache can use now (a shared host budget moves it)."""
        return self.shared.host_pages

    def close(self) -> None:
        """Refuse new calls, let in-flight transfers finish, end its copy grants and pins,
        release the device mapping, and leave its host cache; the last member closes the
        cache (writes what is queued for storage, then releases the host memory and the
        tier). Each step runs even when one before it raised; the first error is raised at
        the end. Idempotent."""
        with self.lock:
            first = not self.closed
            self.closed = True
            if first:
                self._idle.wait_for(lambda: self._busy == 0)
        if not first:  # a concurrent close() releases; return when it has
            self._released.wait()
            return
        try:
            self.shared.leave(self.identity.pool_id, self.events, self._close_own)
        finally:
            self._released.set()

    def _close_own(self) -> None:
        """Release what is this member's alone, each step whatever an earlier one raised."""
        with contextlib.ExitStack() as steps:  # run in reverse order
            if self.device is not None:
                steps.callback(self.device.close)
            if self.offload_events is not None:
                steps.callback(self.offload_events.close)
            steps.callback(self._close_copiers)
            steps.callback(self._unpin_all)
            steps.callback(self.grants.close)

    def check_integrity(self) -> None:
        with self.lock:
            closed = self.closed
        if closed:
            self.index.check_integrity()
            return
        self.cache.check_integrity()
        assert self.host.geometry == self.geometry
        if self.device is not None:
            self.device.check_integrity()
            assert self.device.geometry == self.geometry
