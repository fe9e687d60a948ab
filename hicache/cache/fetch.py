"""Storage -> host: the prefetch worker and load()'s fetch of keys found only in storage.

A mixin of HierarchicalCache (tiering.py), over the write-policy mixin, split out to keep files small; it follows the
cache's locking rules: pages are reserved under the lock, filled outside it, bound under it.
"""

from __future__ import annotations

import functools
import logging
import queue
from collections.abc import Sequence

from hicache.cache.policies import PrefetchPolicy, PrefetchTimeout, check_prefetch_policy
from hicache.cache.prefetch import PrefetchHandle
from hicache.cache.write_policy import Backup, WritePolicyMixin

log = logging.getLogger(__name__)


def unique_keys(keys: Sequence[bytes]) -> list[bytes]:
    """`keys` as a list; ValueError for a key that is not non-empty bytes, or duplicates."""
    keys = list(keys)
    for k in keys:
        if not isinstance(k, bytes) or not k:
            raise ValueError(f"a key must be non-empty bytes, got {k!r}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys in one call: {len(keys) - len(set(keys))} repeated")
    return keys


class FetchMixin(WritePolicyMixin):
    # provided by HierarchicalCache (the write-policy half comes from WritePolicyMixin)
    prefetch_policy: PrefetchPolicy
    prefetch_timeout: PrefetchTimeout
    fetch_batch_pages: int
    _pending: dict[bytes, object]
    _active: dict[int, PrefetchHandle]
    _next_id: int
    _prefetch_queue: queue.Queue[tuple[PrefetchHandle, list[int]] | None]

    # ---- prefetch -------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes], policy: str | None = None) -> PrefetchHandle:
        """Start fetching, in the background, the keys after the host-resident prefix of
        `keys` that form a prefix present in storage. Returns at once; the handle reports
        progress and its result() waits as `policy` (default: the cache's) says. Pages that
        do not fit (pinned/referenced pages fill the pool) are not fetched. Raises ValueError
        for bad keys or an unknown policy."""
        keys = unique_keys(keys)
        chosen = check_prefetch_policy(policy if policy is not None else self.prefetch_policy)
        with self._lock:
            rest = keys[self.index.prefix_length(keys) :]
        present = self.storage.batch_exists(rest) if rest and self.storage.enabled else 0
        with self._lock:
            fetch = [k for k in rest[:present] if k not in self.index and k not in self._pending]
            pages, backups = self._reserve_locked(keys, fetch)
            fetch, no_room = fetch[: len(pages)], fetch[len(pages) :]
            self._next_id += 1
            tokens = len(fetch) * self.pool.geometry.page_size
            handle = PrefetchHandle(
                self._next_id, keys, fetch, chosen, self.prefetch_timeout.seconds(tokens), self._ready_prefix
            )
            handle.no_room = no_room
            handle.depends = list(
                {id(h): h for k in rest[:present] if isinstance(h := self._pending.get(k), PrefetchHandle)}.values()
            )
            for k in fetch:
                self._pending[k] = handle
                self._begin_locked(k)
            self._n["prefetches"] += 1
            if fetch:
                self._active[handle.id] = handle
        self._submit(self._read_evicted(backups))  # before the worker may overwrite those pages
        if fetch:
            self._prefetch_queue.put((handle, pages))
        return handle

    def _ready_prefix(self, keys: list[bytes]) -> int:
        with self._lock:
            return self.index.prefix_length(keys)

    def _room_locked(self, keys: list[bytes]) -> int:
        """Pages that could be had now without evicting a resident key of `keys`."""
        return self.index.room(keys)

    def _reserve_locked(self, keys: list[bytes], fetch: list[bytes]) -> tuple[list[int], list[Backup]]:
        """Pages for as many of `fetch` as fit, never evicting a resident key of `keys`;
        the resident ones become most recently used. Leaves every resident key of `keys`
        resident (a key above a shrunken limit too)."""
        keep = set(keys)
        got = self.index.allocate(min(len(fetch), self.index.room(keep)), keep)
        assert got is not None
        for k in reversed(keys):
            if k in self.index:
                self.index.touch(k)  # head last: most recently used
        pages, evicted = got
        return pages, self._evicted_locked(evicted)

    def _prefetch_loop(self) -> None:
        while True:
            item = self._prefetch_queue.get()
            if item is None:
                return
            handle, pages = item
            try:
                self._fetch_into(handle.fetch, pages, ref=False, handle=handle)
            except Exception:  # a failing tier fails this prefetch's pages, never the worker
                log.exception("prefetch %d: storage fetch failed", handle.id)
            finally:
                handle.finish()
                status = handle.status()
                with self._lock:
                    self._active.pop(handle.id, None)
                    self._n["prefetch_pages"] += status.done
                    self._n["prefetch_failures"] += status.failed

    # ---- load's fetch -----------------------------------------------------------------------
    def _load_from_storage(self, rest: list[bytes]) -> tuple[list[tuple[bytes, int]], bool]:
        """Fetch into host, referenced, the keys at the head of `rest` that are in storage
        and not on host, up to the first one that is on host (or being filled) or missing.
        Never evicts a resident key of `rest` to make room. Also says whether the host ran
        out of room before the run ended."""
        present = self.storage.batch_exists(rest)
        with self._lock:
            fetch = []
            for k in rest[:present]:
                if k in self.index or k in self._pending:
                    break
                fetch.append(k)
            pages, backups = self._reserve_locked(rest, fetch)
            no_room = len(pages) < len(fetch)
            fetch = fetch[: len(pages)]
            for k in fetch:
                self._pending[k] = "load"
                self._begin_locked(k)
        self._submit(self._read_evicted(backups))
        return self._fetch_into(fetch, pages, ref=True, handle=None), no_room

    def _write_fetched(self, pages: list[int], i: int, data: memoryview) -> None:
        self.pool.write_page(pages[i], data)

    def _fetched_pieces(self, pages: list[int], i: int) -> list[memoryview]:
        pieces = self._page_pieces(pages[i])
        if pieces is None:
            raise RuntimeError(f"host page {pages[i]} has no pieces, but the first page of its batch had")
        return pieces

    def _read_batch(self, keys: list[bytes], pages: list[int]) -> int:
        """Read `keys` from storage into `pages`, straight into the pages' bytes where the
        pool gives them (page_pieces: the same for every page of a pool), else through the
        tier's buffer and write_page."""
        if self._page_pieces(pages[0]) is not None:
            return self.storage.batch_read_into(keys, functools.partial(self._fetched_pieces, pages))
        return self.storage.batch_read(keys, functools.partial(self._write_fetched, pages))

    def _fetch_into(
        self, keys: list[bytes], pages: list[int], *, ref: bool, handle: PrefetchHandle | None
    ) -> list[tuple[bytes, int]]:
        """Fill reserved `pages` with `keys` from storage in batches and bind them, stopping
        at the first miss or a cancel; the unused pages go back. Returns what was bound (with
        ref, referenced; if it raises, the pages it bound stay resident, unreferenced)."""
        done: list[tuple[bytes, int]] = []
        failed = True
        try:
            for start in range(0, len(keys), self.fetch_batch_pages):
                if handle is not None and handle.cancelled:
                    break
                chunk = keys[start : start + self.fetch_batch_pages]
                good = self._read_batch(chunk, pages[start:])
                with self._lock:
                    self._apply_removals_locked()
                    for k, page in zip(chunk[:good], pages[start:], strict=False):
                        del self._pending[k]
                        self.index.bind(k, page)
                        if ref:
                            self.index.ref(k)
                        if self._end_locked(k):  # not removed from storage since it was read
                            self._stored.add(k)
                        done.append((k, page))
                if handle is not None:
                    handle.advance(good)
                if good < len(chunk):
                    break
            failed = False
        finally:
            with self._lock:
                for k in keys[len(done) :]:
                    self._pending.pop(k, None)
                    self._end_locked(k)
                self.index.release(pages[len(done) :])
                for k, _ in reversed(done):
                    if failed and ref:
                        self.index.unref(k)  # the caller gets no result to release
                    if k in self.index:  # not dropped meanwhile (drop, evict; unref above the limit)
                        self.index.touch(k)  # the run's head ends most recently used
        return done
