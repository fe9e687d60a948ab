"""The demo engine's own prefix cache over its device pool: page key -> device page, LRU.

This is the engine-side half of the hierarchy (an inference server's radix cache, reduced
to chained page keys). A page is free, cached under a key, or held by a request as
scratch. Cached pages carry a reference count; only unreferenced ones are evicted.
No torch: pages are ints.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hicache.validate import is_int


class DeviceCache:
    """Raises ValueError for a bad page count, KeyError for a page in the wrong state."""

    def __init__(self, num_pages: int):
        if not is_int(num_pages) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._scratch: set[int] = set()
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._cached

    def __len__(self) -> int:
        return len(self._cached)

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are cached."""
        n = 0
        for key in keys:
            if key not in self._cached:
                break
            n += 1
        return n

    def acquire(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of cached `keys`, referenced and made most recently used. Raises KeyError."""
        pages = []
        for key in keys:
            page = self._cached[key]
            self._cached.move_to_end(key)
            self._refs[page] = self._refs.get(page, 0) + 1
            pages.append(page)
        return pages

    @property
    def available(self) -> int:
        """Pages allocate() can hand out now: free plus unreferenced cached pages."""
        return len(self._free) + sum(1 for p in self._cached.values() if not self._refs.get(p))

    def allocate(self, n: int) -> list[int] | None:
        """n scratch pages, evicting least recently used unreferenced pages; None if n do not fit."""
        if n > self.available:
            return None
        while len(self._free) < n:
            victim = next(k for k, p in self._cached.items() if not self._refs.get(p))
            self._free.append(self._cached.pop(victim))
            del self._key_of[self._free[-1]]
            self.evictions += 1
        pages = [self._free.pop() for _ in range(n)]
        self._scratch.update(pages)
        return pages

    def insert(self, key: bytes, page: int) -> None:
        """Turn scratch `page` into the cached page of `key`, referenced once (release it later).
        Raises KeyError if the page is not scratch, ValueError if the key is already cached."""
        if page not in self._scratch:
            raise KeyError(f"page {page} is not a scratch page")
        if key in self._cached:
            raise ValueError(f"key {key.hex()} is already cached in page {self._cached[key]}")
        self._scratch.discard(page)
        self._cached[key] = page
        self._key_of[page] = key
        self._refs[page] = 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference of each cached page; scratch pages go back to the free list."""
        for page in pages:
            if page in self._scratch:
                self._scratch.discard(page)
                self._free.append(page)
            elif page in self._key_of and self._refs.get(page, 0) > 0:
                self._refs[page] -= 1
            else:
                raise KeyError(f"page {page} is neither scratch nor a referenced cached page")

    def check_integrity(self) -> None:
        cached = set(self._cached.values())
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate free page"
        assert not (cached & free or cached & self._scratch or free & self._scratch), "page in two states"
        assert len(cached) + len(free) + len(self._scratch) == self.num_pages, "lost pages"
        assert set(self._key_of) == cached and all(self._cached[k] == p for p, k in self._key_of.items())
        assert all(r >= 0 for r in self._refs.values())
