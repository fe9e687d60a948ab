"""HostIndex: key -> host page, with LRU eviction, pins and references. No torch.

A page is in exactly one state:
- free:     in the free list;
- reserved: handed out by allocate() and not yet bound to a key (a copy is filling it);
- bound:    holds a key. A bound entry with pins == 0 and refs == 0 is evictable and sits
            in the LRU order; a pinned or referenced one is kept out of it, so eviction
            pops the oldest evictable key in O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import islice

from hicache.validate import is_int


class _Entry:
    __slots__ = ("page", "pins", "refs")

    def __init__(self, page: int):
        self.page = page
        self.pins = 0
        self.refs = 0


class HostIndex:
    """Which key each host page holds. Not thread-safe: the owner serialises calls.

    Raises KeyError for unknown keys and ValueError for bad pages or counts. "No space"
    is a None return from allocate(), not an exception.
    """

    def __init__(self, num_pages: int):
        if not is_int(num_pages) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self.limit = num_pages  # pages [0, limit) are usable (resize); above it they retire once free
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low pages first
        self._retired: set[int] = set()  # pages >= limit that hold nothing
        self._retired_new: list[int] = []  # retired since take_retired()
        self._reserved: set[int] = set()
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # evictable keys, oldest first
        self.evictions = 0  # keys dropped to make room (allocate, evict); for stats
        # called with ("stored" | "removed", keys) after each change of what is resident, under
        # the owner's lock, so in order (KV events); must only record, never block
        self.observer: Callable[[str, list[bytes]], None] | None = None
        # called with each key dropped on its release above a shrunken limit (unpin, unref),
        # under the owner's lock, so that the owner forgets what it knew of the key
        self.on_drop: Callable[[bytes], None] | None = None

    # ---- queries ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def evictable_pages(self) -> int:
        return len(self._lru)

    @property
    def reserved_pages(self) -> int:
        return len(self._reserved)

    def room(self, keep: Collection[bytes] = ()) -> int:
        """Pages allocate(n, keep) can hand out: free ones and evictable ones not of `keep`."""
        return len(self._free) + len(self._lru) - sum(1 for k in set(keep) if k in self._lru)

    def page_of(self, key: bytes) -> int | None:
        """The page holding `key`, or None. Does not touch the LRU order."""
        entry = self._entries.get(key)
        return None if entry is None else entry.page

    def pins(self, key: bytes) -> int:
        return self._entry(key).pins

    def refs(self, key: bytes) -> int:
        return self._entry(key).refs

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are resident."""
        n = 0
        for key in keys:
            if key not in self._entries:
                break
            n += 1
        return n

    def keys(self) -> list[bytes]:
        return list(self._entries)

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, n: int, keep: Collection[bytes] = ()) -> tuple[list[int], list[tuple[bytes, int]]] | None:
        """Reserve n pages, evicting least-recently-used keys, never one of `keep`, if needed.

        Returns (pages, evicted (key, page) pairs), or None, with nothing changed, when
        room(keep) < n. The evicted pages are among the returned ones: a caller that keeps
        evicted data (write-back) must read it before overwriting.
        """
        if not is_int(n) or n < 0:
            raise ValueError(f"page count must be an int >= 0, got {n!r}")
        keep = set(keep)
        if n > self.room(keep):
            return None
        need = n - len(self._free)
        victims = list(islice((k for k in self._lru if k not in keep), max(need, 0)))  # oldest first
        evicted = []
        for key in victims:
            del self._lru[key]
            page = self._entries.pop(key).page
            self._free.append(page)  # evictable pages are all below the limit
            evicted.append((key, page))
        self.evictions += len(evicted)
        if evicted and self.observer is not None:
            self.observer("removed", [k for k, _ in evicted])
        pages = [self._free.pop() for _ in range(n)]
        self._reserved.update(pages)
        return pages, evicted

    def bind(self, key: bytes, page: int) -> None:
        """Give reserved `page` the key `key`; it becomes the most recently used."""
        if not isinstance(key, bytes) or not key:
            raise ValueError(f"key must be non-empty bytes, got {key!r}")
        if key in self._entries:
            raise ValueError(f"key {key.hex()} is already resident in page {self._entries[key].page}")
        if page not in self._reserved:
            raise ValueError(f"page {page} is not reserved")
        self._reserved.remove(page)
        self._entries[key] = _Entry(page)
        if page < self.limit:  # above a shrunken limit it stays out of the LRU: never reused
            self._lru[key] = None
        if self.observer is not None:
            self.observer("stored", [key])

    def release(self, pages: Iterable[int]) -> None:
        """Return reserved pages that were never bound (a failed or abandoned copy).
        Raises ValueError, with nothing released, for a page not reserved or listed twice."""
        pages = list(pages)
        seen: set[int] = set()
        for page in pages:
            if page not in self._reserved:
                raise ValueError(f"page {page} is not reserved")
            if page in seen:
                raise ValueError(f"page {page} is listed twice")
            seen.add(page)
        for page in pages:
            self._reserved.remove(page)
            self._give_back(page)

    def remove(self, key: bytes) -> int:
        """Drop `key` and free its page. Raises KeyError if absent, ValueError if pinned or
        referenced."""
        entry = self._entry(key)
        if entry.pins or entry.refs:
            raise ValueError(f"key {key.hex()} is pinned ({entry.pins}) or referenced ({entry.refs})")
        del self._entries[key]
        self._lru.pop(key, None)
        self._give_back(entry.page)
        if self.observer is not None:
            self.observer("removed", [key])
        return entry.page

    def evict(self, n: int) -> list[tuple[bytes, int]]:
        """Free up to n pages of the least recently used evictable keys; returns them."""
        out: list[tuple[bytes, int]] = []
        while len(out) < n and self._lru:
            key, _ = self._lru.popitem(last=False)
            page = self._entries.pop(key).page
            self._give_back(page)
            out.append((key, page))
        self.evictions += len(out)
        if out and self.observer is not None:
            self.observer("removed", [k for k, _ in out])
        return out

    # ---- recency, pins and references -------------------------------------------------------
    def touch(self, key: bytes) -> None:
        """Mark `key` most recently used."""
        self._entry(key)  # raises KeyError if absent
        if key in self._lru:  # pinned/referenced keys rejoin the order at the end when released
            self._lru.move_to_end(key)

    def pin(self, key: bytes) -> None:
        """Protect `key` from eviction until a matching unpin()."""
        self._entry(key).pins += 1
        self._lru.pop(key, None)

    def unpin(self, key: bytes) -> None:
        entry = self._entry(key)
        if entry.pins == 0:
            raise ValueError(f"key {key.hex()} is not pinned")
        entry.pins -= 1
        self._maybe_evictable(key, entry)

    def ref(self, key: bytes) -> int:
        """Hold `key` for an in-flight read; returns its page."""
        entry = self._entry(key)
        entry.refs += 1
        self._lru.pop(key, None)
        return entry.page

    def unref(self, key: bytes) -> None:
        entry = self._entry(key)
        if entry.refs == 0:
            raise ValueError(f"key {key.hex()} is not referenced")
        entry.refs -= 1
        self._maybe_evictable(key, entry)

    def _maybe_evictable(self, key: bytes, entry: _Entry) -> None:
        if entry.pins == 0 and entry.refs == 0:
            if entry.page >= self.limit:  # above a shrunken limit: dropped, not kept
                del self._entries[key]
                self._give_back(entry.page)
                if self.on_drop is not None:
                    self.on_drop(key)
                if self.observer is not None:
                    self.observer("removed", [key])
                return
            self._lru[key] = None  # most recently used

    def _give_back(self, page: int) -> None:
        if page < self.limit:
            self._free.append(page)
        else:
            self._retired.add(page)
            self._retired_new.append(page)

    # ---- resizing -----------------------------------------------------------------------------
    def resize(self, limit: int) -> list[tuple[bytes, int]]:
        """Use pages [0, limit) only. Every call evicts the keys above the limit that are
        neither pinned nor referenced (returned, as evict() does); shrinking retires the free
        pages there, and a pinned or referenced page above it retires when released (its key
        is then dropped: on_drop). A page reserved above it stays out of use when bound, until
        released or the next call. Growing brings retired pages below the new limit back.
        Raises ValueError for a limit outside [1, num_pages]."""
        if not is_int(limit) or not 1 <= limit <= self.num_pages:
            raise ValueError(f"limit must be an int in [1, {self.num_pages}], got {limit!r}")
        old, self.limit = self.limit, limit
        if limit >= old:
            back = sorted((p for p in self._retired if p < limit), reverse=True)
            self._retired.difference_update(back)
            self._free = back + self._free  # pop() takes low pages first: the old ones stay first
            for key, entry in self._entries.items():  # bound above the old limit while it stood
                if entry.page < limit and not entry.pins and not entry.refs and key not in self._lru:
                    self._lru[key] = None
        else:
            keep = [p for p in self._free if p < limit]
            for page in self._free:
                if page >= limit:
                    self._give_back(page)
            self._free = keep
        evicted = [(k, e.page) for k, e in self._entries.items() if e.page >= limit and not e.pins and not e.refs]
        for key, page in evicted:
            self._lru.pop(key, None)
            del self._entries[key]
            self._give_back(page)
        self.evictions += len(evicted)
        if evicted and self.observer is not None:
            self.observer("removed", [k for k, _ in evicted])
        return evicted

    def take_retired(self) -> list[int]:
        """Pages that retired since the last call (their memory can be released)."""
        out, self._retired_new = self._retired_new, []
        return out

    def _entry(self, key: bytes) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            shown = key.hex() if isinstance(key, bytes) else repr(key)
            raise KeyError(f"key {shown} is not resident")
        return entry

    # ---- invariants -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert free + reserved + bound == total, and that index and pages agree."""
        bound = [e.page for e in self._entries.values()]
        assert len(self._free) + len(self._reserved) + len(bound) + len(self._retired) == self.num_pages
        every = set(self._free) | self._reserved | set(bound) | self._retired
        assert every == set(range(self.num_pages)), "a page is lost or held twice"
        assert all(p < self.limit for p in self._free) and all(p >= self.limit for p in self._retired)
        assert all(self._entries[k].page < self.limit for k in self._lru), "an evictable page above the limit"
        for key, entry in self._entries.items():
            assert entry.pins >= 0 and entry.refs >= 0
            evictable = entry.pins == 0 and entry.refs == 0 and entry.page < self.limit
            assert (key in self._lru) == evictable, key.hex()
        assert all(k in self._entries for k in self._lru)
