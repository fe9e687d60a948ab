"""Per-key index operations of HierarchicalCache that answer key by key (the sidecar's
Evict / Pin / Unpin / Lookup calls): a mixin, split out to keep tiering.py small."""

from __future__ import annotations

import threading
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

    def pinned_pages(self) -> int:
        with self._lock:
            return sum(1 for k in self.index.keys() if self.index.pins(k))
