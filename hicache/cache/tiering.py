"""HierarchicalCache: the host pool, its index and a storage tier, with write and prefetch
policies. The control path of the sidecar; it touches page bytes only through the pool's
read_page/write_page and page_pieces (the views a fetch reads into), and never imports torch.

Locking: one lock (`_lock`) guards the HostIndex and every map here (pending keys, queued
writes, hit counts, stored flags, counters). It is never held across storage I/O or a page
copy. Copies are safe outside it because a page being filled is reserved (owned by one
caller until bound) and a page being read for a write is referenced (never evicted). The
storage writer and the prefetch worker are threads of their own; each PrefetchHandle has
its own condition. Lock order: cache lock, then writer/handle conditions, never back.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicache.cache.fetch import FetchMixin, unique_keys
from hicache.cache.index import HostIndex
from hicache.cache.key_ops import KeyOpsMixin
from hicache.cache.offload import ROOM_WAIT_S, OffloadMixin
from hicache.cache.policies import (
    PrefetchPolicy,
    PrefetchTimeout,
    check_prefetch_policy,
    check_write_policy,
)
from hicache.cache.prefetch import PrefetchHandle
from hicache.cache.results import LoadResult, PagePool, Tier
from hicache.cache.writer import StorageWriter
from hicache.geometry import KVGeometry
from hicache.storage.base import StorageTier, TierIdentity
from hicache.storage.null import NullTier


class HierarchicalCache(KeyOpsMixin, OffloadMixin, FetchMixin):
    """Host pages addressed by key, over a storage tier. Thread-safe.

    write_policy: "write_through" (every offloaded page is also stored), "write_through_
    selective" (stored when used a second time: a re-offload or a load from host), or
    "write_back" (stored when evicted from host). Storage writes run on a background thread
    and never block. prefetch_policy: how PrefetchHandle.result() waits (see prefetch.py).
    Raises ValueError for a bad policy, a tier whose identity does not match the pool's
    geometry, or bad keys (not bytes, empty, duplicated).
    """

    def __init__(
        self,
        pool: PagePool,
        storage: StorageTier | None = None,
        *,
        write_policy: str = "write_through",
        prefetch_policy: str = "best_effort",
        prefetch_timeout: PrefetchTimeout | None = None,
        max_write_queue: int = 1024,
        write_batch_pages: int = 32,
        fetch_batch_pages: int = 16,
    ):
        g = pool.geometry
        if storage is not None and (
            storage.identity.fingerprint != g.fingerprint or storage.identity.page_bytes != g.page_bytes
        ):
            raise ValueError(
                f"storage tier is for geometry {storage.identity.fingerprint}, the pool's is {g.fingerprint}"
            )
        self.pool = pool
        self.storage = storage if storage is not None else NullTier(TierIdentity.for_geometry(g, "none"))
        self.write_policy = check_write_policy(write_policy)
        self.prefetch_policy: PrefetchPolicy = check_prefetch_policy(prefetch_policy)
        self.prefetch_timeout = prefetch_timeout or PrefetchTimeout()
        if fetch_batch_pages < 1:
            raise ValueError(f"fetch_batch_pages must be >= 1, got {fetch_batch_pages}")
        self.fetch_batch_pages = fetch_batch_pages
        self.index = HostIndex(pool.num_pages)
        self.index.on_drop = self._forget  # a key dropped on release above a shrunken limit
        self._lock = threading.RLock()
        self._pending: dict[bytes, object] = {}  # reserved key -> its Reservation's owner, "load" or PrefetchHandle
        self._queued: set[bytes] = set()  # keys referenced by a queued storage write
        self._stored: set[bytes] = set()  # resident keys known to be in storage
        self._in_flight: dict[bytes, int] = {}  # key -> its fetches and writes begun, not yet ended
        self._dropped: set[bytes] = set()  # keys of _in_flight the tier removed meanwhile
        self._removals: list[bytes] = []  # keys the tier removed while the cache lock was busy
        self._removals_lock = threading.Lock()  # guards _removals (taken under the tier's lock)
        self._hits: dict[bytes, int] = {}  # write_through_selective: uses of resident, unstored keys
        self._n: dict[str, int] = dict.fromkeys(
            ("host_hits host_misses storage_hits storage_misses writes_queued writes_done write_failures "
             "writes_dropped prefetches prefetch_pages prefetch_failures").split(), 0
        )  # fmt: skip
        self._writer = StorageWriter(
            self.storage, self._read_job, self._write_done, max_queue=max_write_queue, batch_pages=write_batch_pages
        )
        self._prefetch_queue: queue.Queue[tuple[PrefetchHandle, list[int]] | None] = queue.Queue()
        self._active: dict[int, PrefetchHandle] = {}
        self._next_id = 0
        self._prefetcher = threading.Thread(target=self._prefetch_loop, name="hicache-prefetch", daemon=True)
        self._prefetcher.start()
        self._watcher = self._storage_changed  # one bound method, so that close() can remove it
        self.storage.add_watcher(self._watcher)

    @property
    def geometry(self) -> KVGeometry:
        return self.pool.geometry

    # ---- queries and reload: host -> engine -------------------------------------------------
    def with_host_keys(self, fn: Callable[[list[bytes]], None]) -> None:
        """Call fn(every resident key) under the cache lock: no index change runs meanwhile
        (a KV-event snapshot that agrees with the events published before and after it)."""
        with self._lock:
            fn(self.index.keys())

    def lookup(self, keys: Sequence[bytes]) -> list[Tier]:
        """For each key, where it is: "host", "storage" or "none". Changes nothing."""
        keys = list(keys)
        with self._lock:
            where: list[Tier] = ["host" if k in self.index else "none" for k in keys]
        rest = [i for i, w in enumerate(where) if w == "none"]
        if rest and self.storage.enabled:
            for i, present in zip(rest, self.storage.batch_contains([keys[i] for i in rest]), strict=True):
                if present:
                    where[i] = "storage"
        return where

    def load(self, keys: Sequence[bytes]) -> LoadResult:
        """Reference the longest prefix of `keys` that is on host or can be fetched from
        storage; keys only in storage are fetched into host first (source "storage"), and
        runs on host and in storage may alternate. Waits for in-flight prefetches of these
        keys, and, while the host has no room for a fetch because its pages wait for storage
        writes, for those writes (ROOM_WAIT_S at most). Call release(result.keys) after the
        host -> device copy."""
        keys = unique_keys(keys)
        with self._lock:
            tasks = {id(t): t for k in keys if isinstance(t := self._pending.get(k), PrefetchHandle)}
        for t in tasks.values():
            t.wait()
        out: list[bytes] = []
        pages: list[int] = []
        sources: list[Tier] = []
        deadline = time.monotonic() + ROOM_WAIT_S
        try:
            while len(out) < len(keys):
                with self._lock:
                    run = []
                    for k in keys[len(out) :]:
                        if k not in self.index:
                            break
                        pages.append(self.index.ref(k))
                        run.append(k)
                    writes = self._note_use(run)
                out += run
                sources += ["host"] * len(run)
                self._submit(writes)
                rest = keys[len(out) :]
                if not rest or not self.storage.enabled:
                    break
                got, no_room = self._load_from_storage(rest)
                if not got:  # host pages queued for storage writes: wait for them, within a bound
                    if no_room and self.wait_for_room(deadline - time.monotonic()):
                        continue
                    break
                out += [k for k, _ in got]
                pages += [p for _, p in got]
                sources += ["storage"] * len(got)
        except BaseException:
            self.release(out)  # the caller gets no result to release
            raise
        from_host = sources.count("host")
        with self._lock:
            self._n["host_hits"] += from_host
            self._n["host_misses"] += len(keys) - from_host
            if self.storage.enabled:
                self._n["storage_hits"] += len(out) - from_host
                self._n["storage_misses"] += len(keys) - len(out)
        return LoadResult(out, pages, sources)

    def evict(self, n: int) -> int:
        """Evict up to n least recently used pages (write_back stores them first)."""
        with self._lock:
            evicted = self.index.evict(n)
            backups = self._evicted_locked(evicted)
            jobs = self._read_evicted(backups)  # under the lock: the freed pages are not reserved
        self._submit(jobs)
        return len(evicted)

    def resize_host(self, pages: int) -> list[int]:
        """Use host pages [0, pages) only (a shared host budget moved). Shrinking evicts the
        evictable keys above the line (write_back stores them first); a key there that is
        pinned or being read is dropped when released, without a write-back, and its page is
        returned by the next call. A key bound there after the shrink (its copy was in flight)
        stays resident, never evicted to make room, until a reference or pin of it ends or
        the next call evicts it. Returns the pages above the line that hold nothing now, whose memory the caller
        may give back. A caller that grows commits the memory of the pages that come back
        first. Calls must not overlap (the sidecar rebalances under one lock). Raises ValueError for pages outside [1, the pool's pages]."""
        with self._lock:
            evicted = self.index.resize(pages)
            backups = self._evicted_locked(evicted)
            jobs = self._read_evicted(backups)  # before the caller gives the memory back
            retired = [p for p in self.index.take_retired() if p >= self.index.limit]
        self._submit(jobs)
        return retired

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued storage writes; False if `timeout` seconds pass first."""
        return self._writer.flush(timeout)

    # ---- status -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Host pages/bytes, hits and misses per tier, write queue depth, failures, and the
        storage tier's own stats under "storage"."""
        storage = self.storage.stats()
        with self._lock:
            used = len(self.index)
            out: dict[str, Any] = {
                "host_pages": self.index.limit,
                "host_used_pages": used,
                "host_free_pages": self.index.free_pages,
                "host_bytes": used * self.geometry.page_bytes,
                "write_policy": self.write_policy,
                "prefetch_policy": self.prefetch_policy,
                "write_queue_depth": self._writer.depth,
                "writer_errors": self._writer.errors,
                "prefetches_active": len(self._active),
                **self._n,
            }
        out["storage_healthy"] = storage.healthy
        out["storage"] = storage.to_dict()
        return out

    def check_integrity(self) -> None:
        """Assert the index is consistent, every reserved page has a pending key, every
        queued write holds a reference, and the metadata names only resident keys."""
        with self._lock:
            self.index.check_integrity()
            assert self.index.reserved_pages == len(self._pending), (self.index.reserved_pages, len(self._pending))
            assert all(k not in self.index for k in self._pending)
            for k in self._queued:
                assert self.index.refs(k) >= 1, k.hex()
            assert all(k in self.index for k in self._stored)
            assert self._dropped <= self._in_flight.keys(), [k.hex() for k in self._dropped - self._in_flight.keys()]
            assert all(k in self.index for k in self._hits)
        check = getattr(self.pool, "check_integrity", None)
        if check is not None:
            check()

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel prefetches, write what is queued (up to `timeout` s), stop the threads.
        The storage tier stays open: it belongs to the caller (the cache stops watching it)."""
        with self._lock:
            for h in self._active.values():
                h.cancel()
        self._prefetch_queue.put(None)
        self._prefetcher.join(timeout)
        self._writer.close(timeout)
        self.storage.remove_watcher(self._watcher)
