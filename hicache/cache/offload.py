"""The offload path of HierarchicalCache, engine -> host: reserve host pages for new keys,
commit them once their data is copied in (applying the write policy), or abort a failed
copy; put() does all three for a caller that holds the page bytes.

A mixin of HierarchicalCache (tiering.py), over the write-policy mixin; it follows the
cache's locking rules: pages are reserved under the lock, filled outside it, bound under it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hicache.cache.fetch import unique_keys
from hicache.cache.results import Reservation
from hicache.cache.write_policy import Backup, WritePolicyMixin
from hicache.storage.base import Buffer

ROOM_WAIT_S = 10.0  # a call waits at most this long in all for storage writes to free host pages


class OffloadMixin(WritePolicyMixin):
    # provided by HierarchicalCache (the page reservation by FetchMixin)
    _pending: dict[bytes, object]
    _room_locked: Callable[[list[bytes]], int]
    _reserve_locked: Callable[[list[bytes], list[bytes]], tuple[list[int], list[Backup]]]

    def reserve(self, keys: Sequence[bytes], *, partial: bool = False) -> Reservation | None:
        """Host pages for the keys not yet on host, evicting LRU pages (never these keys) if
        needed; keys already on host become most recently used. None, with no page taken,
        when there is no room (pinned/referenced pages fill the pool); with partial=True,
        the earliest new keys that fit are reserved and the rest listed as refused."""
        keys = unique_keys(keys)
        with self._lock:
            existing = [(k, p) for k in keys if (p := self.index.page_of(k)) is not None]
            pending = [k for k in keys if k in self._pending]
            new = [k for k in keys if k not in self.index and k not in self._pending]
            if not partial and len(new) > self._room_locked(keys):
                return None
            pages, backups = self._reserve_locked(keys, new)
            new, refused = new[: len(pages)], new[len(pages) :]
            reservation = Reservation(list(zip(new, pages, strict=True)), existing, pending, refused)
            for k in new:
                self._pending[k] = reservation.owner
            writes = self._note_use([k for k, _ in existing])
        self._submit(writes + self._read_evicted(backups))
        return reservation

    def wait_for_room(self, timeout: float) -> bool:
        """Wait for host pages that queued storage writes hold to be written (then they can
        be evicted): True when a write batch finished, False when no write holds a page, or
        the writer is stalled, or `timeout` s pass first."""
        with self._lock:
            if not self._queued:
                return False
        return self._writer.wait_written(timeout)

    def wait_for_room_for(self, keys: Sequence[bytes], timeout: float) -> None:
        """Wait (wait_for_room, `timeout` s in all) until the host has room for the keys of
        `keys` not on it yet, or no storage write can free a page any more."""
        deadline = time.monotonic() + timeout
        keys = unique_keys(keys)
        while True:
            with self._lock:
                need = sum(1 for k in keys if k not in self.index and k not in self._pending)
                if need <= self._room_locked(keys):
                    return
            if not self.wait_for_room(deadline - time.monotonic()):
                return

    def commit(self, reservation: Reservation) -> None:
        """The data of reservation.new is in its pages: make the keys resident and apply the
        write policy. Raises ValueError if the reservation was already committed or aborted."""
        with self._lock:
            self._take_reserved_locked(reservation)
            for k, page in reversed(reservation.new):
                self.index.bind(k, page)  # head last: a prefix's head outlives its tail
            keys = [k for k, _ in reservation.new]
            if self.write_policy == "write_through":
                writes = self._queue_locked(keys)
            else:
                writes = self._note_use(keys)
        self._submit(writes)

    def abort(self, reservation: Reservation) -> None:
        """Give back the pages of a reservation whose copy failed."""
        with self._lock:
            self._take_reserved_locked(reservation)
            self.index.release([p for _, p in reservation.new])

    def _take_reserved_locked(self, reservation: Reservation) -> None:
        """End the reservation's pending state; ValueError, with nothing changed, if it was
        already committed or aborted."""
        for k, _ in reservation.new:
            if self._pending.get(k) is not reservation.owner:
                raise ValueError(f"key {k.hex()} is not reserved for an offload")
        for k, _ in reservation.new:
            del self._pending[k]

    def put(self, keys: Sequence[bytes], pages_data: Sequence[Buffer]) -> bool:
        """reserve + write_page + commit, for callers that hold page bytes. False if no room."""
        if len(keys) != len(pages_data):
            raise ValueError(f"{len(keys)} keys but {len(pages_data)} pages of data")
        res = self.reserve(keys)
        if res is None:
            return False
        data = dict(zip(keys, pages_data, strict=True))
        try:
            for k, page in res.new:
                self.pool.write_page(page, data[k])
        except BaseException:
            self.abort(res)
            raise
        self.commit(res)
        return True
