"""Write policies of HierarchicalCache: which host pages go to storage, and when.

A mixin of HierarchicalCache (tiering.py). Methods ending in _locked, and _note_use and
_forget, run with the cache lock held; _submit and _read_evicted run without it.
- write_through: commit() queues every newly offloaded key.
- write_through_selective: _note_use() counts uses (offload, re-offload, load from host)
  and queues a key at its SELECTIVE_HITS-th use.
- write_back: _evicted_locked() picks evicted keys not known to be stored (and, for a tier
  that drops keys unannounced, such as Redis with a TTL or maxmemory, the known ones too, to
  be written only if the tier no longer has them); their bytes are read before the page is
  handed out again.
A queued key holds a reference on its host page until the writer reports it (_write_done),
so the page cannot be evicted or reused while it waits.

A key is marked stored (_stored) when a fetch read it from storage or a write stored it,
and unmarked when the tier reports it removed (_storage_changed: its cap evicted it, it was
found corrupt, another pool deleted it), so write_back writes it again when the host evicts
it. A removal that lands while a fetch or write of the key is in flight (_in_flight) keeps
that operation from marking it stored (_dropped).
"""

from __future__ import annotations

import threading
from typing import Any

from hicache.cache.index import HostIndex
from hicache.cache.policies import SELECTIVE_HITS, WritePolicy
from hicache.cache.writer import StorageWriter, WriteJob
from hicache.storage.base import Buffer, Payload, StorageTier

Backup = tuple[bytes, int, bool]  # an evicted key, its page, whether to write it only if the tier lost it


class WritePolicyMixin:
    # provided by HierarchicalCache
    pool: Any
    storage: StorageTier
    index: HostIndex
    write_policy: WritePolicy
    _lock: threading.RLock
    _writer: StorageWriter
    _queued: set[bytes]
    _stored: set[bytes]
    _in_flight: dict[bytes, int]
    _dropped: set[bytes]
    _removals: list[bytes]
    _removals_lock: threading.Lock
    _hits: dict[bytes, int]
    _n: dict[str, int]

    def _storage_changed(self, change: str, keys: list[bytes]) -> None:
        """The tier's watcher: removed keys are no longer stored. It runs under the tier's
        lock, so it never waits for the cache lock: when that is busy, the keys wait in
        _removals for the next holder (_apply_removals_locked)."""
        if change != "removed":
            return
        with self._removals_lock:
            self._removals.extend(keys)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_removals_locked()
            finally:
                self._lock.release()

    def _apply_removals_locked(self) -> None:
        with self._removals_lock:
            keys, self._removals = self._removals, []
        for k in keys:
            self._stored.discard(k)
            if k in self._in_flight:
                self._dropped.add(k)

    def _begin_locked(self, key: bytes) -> None:
        """A fetch or write of `key` starts: a removal from now on keeps it from being marked stored."""
        self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def _end_locked(self, key: bytes) -> bool:
        """A fetch or write of `key` begun by _begin_locked ended: whether it may mark the
        key stored (false if the tier removed the key meanwhile). Call
        _apply_removals_locked first."""
        left = self._in_flight.pop(key) - 1
        fresh = key not in self._dropped
        if left:
            self._in_flight[key] = left
        else:
            self._dropped.discard(key)
        return fresh

    def _note_use(self, keys: list[bytes]) -> list[WriteJob]:
        if self.write_policy != "write_through_selective":
            return []
        self._apply_removals_locked()
        hot = []
        for k in keys:
            if k in self._stored or k in self._queued:
                continue
            self._hits[k] = self._hits.get(k, 0) + 1
            if self._hits[k] >= SELECTIVE_HITS:
                hot.append(k)
        return self._queue_locked(hot)

    def _queue_locked(self, keys: list[bytes]) -> list[WriteJob]:
        if not self.storage.enabled:
            return []
        self._apply_removals_locked()
        jobs = []
        for k in keys:
            if k in self._stored or k in self._queued:
                continue
            jobs.append(WriteJob(k, self.index.ref(k)))
            self._queued.add(k)
            self._begin_locked(k)
            self._hits.pop(k, None)
        return jobs

    def _evicted_locked(self, evicted: list[tuple[bytes, int]]) -> list[Backup]:
        """The evicted (key, page, if_missing) that write_back must write: those not known
        to be stored, and, where the tier forgets keys on its own, the others too, written
        only if the tier lost them meanwhile (the writer asks it first)."""
        self._apply_removals_locked()
        backups: list[Backup] = []
        if self.write_policy == "write_back" and self.storage.enabled:
            unsure = self.storage.forgets_on_its_own
            for k, page in evicted:
                stored = k in self._stored
                if not stored or unsure:
                    backups.append((k, page, stored))
                    self._begin_locked(k)
        for k, _ in evicted:
            self._forget(k)
        return backups

    def _forget(self, key: bytes) -> None:
        self._stored.discard(key)
        self._hits.pop(key, None)

    def _read_evicted(self, backups: list[Backup]) -> list[WriteJob]:
        return [WriteJob(k, None, self._page_bytes(p), if_missing) for k, p, if_missing in backups]

    def _page_bytes(self, page: int) -> Buffer:
        data = self.pool.read_page(page)  # a fresh uint8 tensor: .numpy() shares its memory
        return memoryview(data.numpy()) if hasattr(data, "numpy") else memoryview(data)

    def _submit(self, jobs: list[WriteJob]) -> None:
        if not jobs:
            return
        rejected = self._writer.submit(jobs)
        with self._lock:
            self._n["writes_queued"] += len(jobs) - len(rejected)
            self._n["writes_dropped"] += len(rejected)
        self._write_done(rejected, [False] * len(rejected), counted=True)

    def _read_job(self, job: WriteJob) -> Payload | None:
        """The bytes of a queued page. The job holds a reference on its host page until
        _write_done, so a page with pieces (page_pieces: its views in canonical order, one
        for a page_first_direct pool, one per layer and K/V for layer_first) is written
        straight from the pool, with no copy; others are copied out with read_page."""
        if job.page is None:
            return None
        pieces = self._page_pieces(job.page)
        if pieces is not None:
            return list(pieces)
        return self._page_bytes(job.page)

    def _page_pieces(self, page: int) -> list[memoryview] | None:
        """The pool's writable views of `page` in canonical order (page_pieces), or None
        where it has none (a GPU pool, too many rows, or a pool without the method)."""
        pieces = getattr(self.pool, "page_pieces", None)
        return pieces(page) if pieces is not None else None

    def _write_done(self, jobs: list[WriteJob], ok: list[bool], counted: bool = False) -> None:
        with self._lock:
            self._apply_removals_locked()
            for job, good in zip(jobs, ok, strict=True):
                if job.page is not None and job.key in self._queued:  # a page held since queueing
                    self._queued.discard(job.key)
                    self.index.unref(job.key)
                if self._end_locked(job.key) and good and job.key in self.index:
                    self._stored.add(job.key)
            if not counted:
                self._n["writes_done"] += sum(ok)
                self._n["write_failures"] += len(ok) - sum(ok)
