"""The copies into a registered pool's host cache: offload from the engine's mapped pages
(waiting on the engine's CUDA event when it names one), and the copy grants of copy path
"engine", where the engine copies into and out of the host pages itself."""

from __future__ import annotations

import time
from collections.abc import Sequence

from hicache.api import (
    CopyGrant,
    KeyStatus,
    TransferResult,
)
from hicache.cache.offload import ROOM_WAIT_S
from hicache.sidecar.operations import (
    offload_statuses,
)
from hicache.sidecar.pool_state import PoolState
from hicache.transfer.cuda import StreamHook
from hicache.validate import is_int


class PoolOffloads(PoolState):
    """Offload and the copy grants of RegisteredPool."""

    # ---- transfers ------------------------------------------------------------------------
    def offload(self, keys: Sequence[bytes], device_pages: Sequence[int], ready_event: int = 0) -> TransferResult:
        """Copy device_pages[i] to host under keys[i]. A key already on host (or being filled)
        is DEDUPLICATED; keys past the free + evictable host pages are NO_SPACE (the earliest
        keys get stored). The write policy then decides what goes to storage. ready_event:
        1 + the index of the engine's offload event the copy waits for on the GPU; 0: none."""
        ks = self.check_keys(keys, unique=True)
        pages = self.check_pages(device_pages, len(ks))
        ready = self._ready_hook(ready_event)
        with self._in_flight():  # first: close() may have released the device memory
            self.check_device()
            return self._offload(ks, pages, ready)

    # ---- the engine's own copies (copy path "engine") ------------------------------------------
    def begin_copy(self, keys: Sequence[bytes], *, offload: bool) -> CopyGrant:
        """Grant host pages for the engine to copy into (offload) or out of (reload); see
        hicache.sidecar.grants. Any pool may be asked; one whose memory the sidecar cannot
        map can only be asked this."""
        ks = self.check_keys(keys, unique=True)
        with self._in_flight():
            grant = self.grants.offload(ks) if offload else self.grants.reload(ks)
        if offload:
            with self.lock:
                c = self.counters
                c.deduplicated += grant.statuses.count(KeyStatus.DEDUPLICATED)
                c.no_space += grant.statuses.count(KeyStatus.NO_SPACE)
        return grant

    def end_copy(self, grant_id: str, *, commit: bool, copy_seconds: float = 0.0) -> int:
        """End a grant (see CopyGrants.end); returns its pages. copy_seconds: the engine's
        copy time, for the pool's GB/s. Raises UnknownId for an unknown or expired grant."""
        if not isinstance(copy_seconds, float | int) or not 0 <= copy_seconds < float("inf"):
            raise ValueError(f"copy_seconds must be a finite number >= 0, got {copy_seconds!r}")
        with self._in_flight():
            offload, pages = self.grants.end(grant_id, commit)
        if commit:
            nbytes = pages * self.geometry.page_bytes
            with self.lock:
                c = self.counters
                if offload:
                    c.offload_bytes, c.offload_s, c.stored = (
                        c.offload_bytes + nbytes,
                        c.offload_s + copy_seconds,
                        c.stored + pages,
                    )
                else:
                    c.reload_bytes, c.reload_s = c.reload_bytes + nbytes, c.reload_s + copy_seconds
        return pages

    def _ready_hook(self, ready_event: int) -> StreamHook | None:
        """The copy stream's wait for the engine's event `ready_event` (1-based). Raises ValueError."""
        if ready_event == 0:
            return None
        count = len(self.offload_events) if self.offload_events is not None else 0
        if not is_int(ready_event) or not 1 <= ready_event <= count:
            raise ValueError(
                f"ready_event must be 0 or 1..{count} (the pool's registered offload events), got {ready_event!r}"
            )
        events, index = self.offload_events, ready_event - 1
        assert events is not None
        return lambda stream: events.wait(index, stream)

    def _offload(self, ks: list[bytes], pages: list[int], ready: StreamHook | None = None) -> TransferResult:
        """Copy what the host has room for; while pages queued for storage fill the host, wait
        for their writes (the tier's pace, at most ROOM_WAIT_S in all) and copy the rest."""
        where = dict(zip(ks, pages, strict=True))
        statuses: dict[bytes, KeyStatus] = {}
        nbytes, deadline, todo = 0, time.monotonic() + ROOM_WAIT_S, ks
        while True:
            res = self.cache.reserve(todo, partial=True)
            assert res is not None
            t0 = time.perf_counter()
            try:
                n = self._copier.offload([where[k] for k, _ in res.new], [p for _, p in res.new], ready=ready)
            except BaseException:
                self.cache.abort(res)
                raise
            self.cache.commit(res)
            nbytes += n
            seconds = time.perf_counter() - t0
            statuses.update(zip(todo, offload_statuses(res, todo), strict=True))
            with self.lock:
                c = self.counters
                c.offload_bytes += n
                c.offload_s += seconds if res.new else 0.0
                c.stored += len(res.new)
                c.deduplicated += len(res.existing) + len(res.pending)
            todo = res.refused
            left = deadline - time.monotonic()
            if not todo or left <= 0 or not self.cache.wait_for_room(left):
                break
        with self.lock:
            self.counters.no_space += len(todo)
        return TransferResult(tuple(statuses[k] for k in ks), nbytes)
