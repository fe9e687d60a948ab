"""HierarchicalCache's operations on the host index alone, which move no page data:
references (release), pins, removal, and the key-by-key answers of the sidecar's Evict /
Pin / Unpin / Lookup calls. A mixin; HierarchicalCache provides the lock and the index."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal

from hicache.cache.index import HostIndex

DropStatus = Literal["evicted", "not_found", "busy"]
PinStatus = Literal["pinned", "unpinned", "not_pinned", "not_found"]


class KeyOpsMixin:
    # provided by HierarchicalCache
    _lock: threading.RLock
    index: HostIndex
    _queued: set[bytes]
    _forget: Callable[[bytes], None]  # WritePolicyMixin's: drops the key's storage bookkeeping

    def release(self, keys: Sequence[bytes]) -> None:
        """Drop the references load() took, head last (so it stays most recently used).
        Raises KeyError/ValueError, with nothing released, for a key not held."""
        keys = list(keys)
        with self._lock:
            for k, n in Counter(keys).items():
                if self.index.refs(k) < n:  # KeyError if absent
                    raise ValueError(f"key {k.hex()} is not referenced {n} time(s)")
            for k in reversed(keys):
                self.index.unref(k)

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep resident keys from eviction until unpin(). Raises KeyError if one is absent."""
        with self._lock:
            for k in keys:
                self.index.pins(k)  # raises KeyError before anything is pinned
            for k in keys:
                self.index.pin(k)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo pin(). Raises KeyError/ValueError, with nothing unpinned, for a key not pinned."""
        keys = list(keys)
        with self._lock:
            for k, n in Counter(keys).items():
                if self.index.pins(k) < n:  # KeyError if absent
                    raise ValueError(f"key {k.hex()} is not pinned {n} time(s)")
            for k in keys:
                self.index.unpin(k)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop resident keys without storing them (invalidation); returns how many went.
        Keys waiting for their storage write stay. Raises ValueError, with nothing removed,
        if one is pinned or referenced."""
        with self._lock:
            going = list(dict.fromkeys(k for k in keys if k in self.index and k not in self._queued))
            for k in going:
                if self.index.pins(k) or self.index.refs(k):
                    raise ValueError(f"key {k.hex()} is pinned or in use")
            for k in going:
                self.index.remove(k)
                self._forget(k)
            return len(going)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make the resident ones of `keys` most recently used, the first one last (so a
        prefix's head outlives its tail)."""
        with self._lock:
            for k in reversed(list(keys)):
                if k in self.index:
                    self.index.touch(k)

    def drop(self, keys: Sequence[bytes]) -> list[DropStatus]:
        """Remove each resident key from host without storing it: "evicted", "not_found", or
        "busy" (pinned, being read, or waiting for its storage write)."""
        out: list[DropStatus] = []
        with self._lock:
            for k in keys:
                if k not in self.index:
                    out.append("not_found")
                elif self.index.pins(k) or self.index.refs(k) or k in self._queued:
                    out.append("busy")
                else:
                    self.index.remove(k)
                    self._forget(k)
                    out.append("evicted")
        return out

    def pin_each(self, keys: Sequence[bytes]) -> list[PinStatus]:
        """Pin each resident key ("pinned"); absent keys are "not_found"."""
        out: list[PinStatus] = []
        with self._lock:
            for k in keys:
                if k in self.index:
                    self.index.pin(k)
                    out.append("pinned")
                else:
                    out.append("not_found")
        return out

    def unpin_each(self, keys: Sequence[bytes]) -> list[PinStatus]:
        """Drop one pin of each key: "unpinned", "not_pinned" or "not_found"."""
        out: list[PinStatus] = []
        with self._lock:
            for k in keys:
                if k not in self.index:
                    out.append("not_found")
                elif self.index.pins(k) == 0:
                    out.append("not_pinned")
                else:
                    self.index.unpin(k)
                    out.append("unpinned")
        return out

    def resident(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is on host now."""
        with self._lock:
            return [k in self.index for k in keys]

    def pinned_pages(self) -> int:
        with self._lock:
            return sum(1 for k in self.index.keys() if self.index.pins(k))
