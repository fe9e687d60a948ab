"""The file tier's index: which page files its folder holds, by key, with their sizes in LRU order.

The index (key -> size, least recent first) lives in memory and is rebuilt by scanning the
folder on start, oldest modification first; a file that is not the page file of the key its
name spells (another folder, upper-case hex) is deleted and counted corrupt, and a temporary
file (a write that was never acknowledged) is deleted. Removal, eviction under the size cap
and the tier's status work on the index too. FileIndex is a base of FileTier (file.py), the
class to use; file_reads and file_writes hold its read and write paths.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from hicache.storage import page_format as fmt
from hicache.storage.base import StorageTier, TierHealth, TierStats

log = logging.getLogger("hicache.storage.file")  # the file tier's one logger

PAGE_SUFFIX = ".page"
TMP_SUFFIX = ".tmp"


class FileIndex(StorageTier):
    """The index of a file tier's folder (FileTier's __init__ sets the state below)."""

    root: Path  # <dir>/<identity qualifier>
    max_bytes: int | None
    fsync: bool | str
    _lock: threading.Lock  # guards _index and _total; held for index changes and unlinks
    _index: OrderedDict[bytes, int]  # key -> file size, least recent first
    _total: int
    _disk_full: bool
    _durable_dirs: set[Path]  # shard folders whose own entry in root is known durable

    # ---- paths and scanning ---------------------------------------------------------------------
    def path_of(self, key: bytes) -> Path:
        """The page file of `key` (it may not exist)."""
        h = key.hex()
        return self.root / h[:2] / (h + PAGE_SUFFIX)

    def _scan(self) -> None:
        found: list[tuple[int, bytes, int]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            self._durable_dirs.add(sub)  # its entry was in the root when _make_root fsynced it
            for entry in os.scandir(sub):
                if entry.name.endswith(TMP_SUFFIX):  # a write that was never acknowledged
                    remove_file(entry.path)
                    continue
                if not entry.name.endswith(PAGE_SUFFIX):
                    continue
                key = _key_of(sub.name, entry.name)
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if key is None or not stat.S_ISREG(st.st_mode) or st.st_size != fmt.stored_size(self.identity, key):
                    remove_file(entry.path)
                    self._count(corrupt=1)
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._total += size
            self._evict_locked(keep=None)

    # ---- lookups --------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        fmt.check_key(key)
        with self._lock:
            return key in self._index

    def batch_contains(self, keys: Sequence[bytes]) -> list[bool]:
        for key in keys:
            fmt.check_key(key)
        with self._lock:
            return [k in self._index for k in keys]

    # ---- removal and eviction -------------------------------------------------------------------
    def _refuse(self, key: bytes, path: Path, seen: os.stat_result, why: str) -> None:
        """A page file that is not a page: deleted, counted corrupt, served as a miss."""
        log.warning("file tier: %s; deleted", why)
        self._drop(key, path, seen)
        self._count(misses=1, corrupt=1)

    def _drop(self, key: bytes, path: Path, seen: os.stat_result) -> None:
        with self._lock:
            self._drop_locked(key, path, seen)

    def _drop_locked(self, key: bytes, path: Path, seen: os.stat_result) -> None:
        """Remove `key`'s page file `path`, as `seen` (its stat) when read or written, unless a
        write has replaced it since: a rename puts another inode there, a newer page that may
        have been acknowledged already."""
        try:
            now = os.lstat(path)
        except OSError:
            now = None  # deleted or evicted meanwhile
        if now is None or (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino):
            self._remove_locked(key, path)

    def delete(self, key: bytes, *, count: bool = True) -> bool:
        fmt.check_key(key)
        with self._lock:
            gone = self._remove_locked(key, self.path_of(key))
        if count and gone:
            self._count(deletes=1)
        return gone

    def _remove_locked(self, key: bytes, path: Path) -> bool:
        """Unlink `key`'s page file `path` and drop the key from the index; whether either was
        there (then the watchers are told)."""
        size = self._index.pop(key, None)
        if size is not None:
            self._total -= size
        removed = remove_file(path)
        if removed or size is not None:
            self._changed("removed", [key])  # under the lock: after any STORED of the key
        return removed or size is not None

    def _evict_locked(self, keep: bytes | None) -> None:
        if self.max_bytes is None:
            return
        evicted = []
        while self._total > self.max_bytes and self._index:
            key, size = next(iter(self._index.items()))
            if key == keep:
                if len(self._index) == 1:
                    break
                self._index.move_to_end(key)
                continue
            del self._index[key]
            self._total -= size
            remove_file(self.path_of(key))
            self._count(evictions=1)
            evicted.append(key)
        self._changed("removed", evicted)

    # ---- status ---------------------------------------------------------------------------------
    def health(self) -> TierHealth:
        """Unhealthy while the folder is not writable, or while the disk is full (from a
        write that failed with ENOSPC/EDQUOT until one succeeds); reads still serve."""
        if not os.access(self.root, os.W_OK):
            return TierHealth(False, f"{self.root} is not writable")
        if self._disk_full:
            return TierHealth(False, f"{self.root}: disk full, page writes fail (reads still serve)")
        return TierHealth(True)

    def _fill_stats(self, snap: TierStats) -> None:
        with self._lock:
            snap.pages, snap.bytes, snap.capacity_bytes = len(self._index), self._total, self.max_bytes

    def check_integrity(self) -> None:
        """Assert the index's sizes add up, the cap holds, and every indexed file exists."""
        with self._lock:
            assert self._total == sum(self._index.values()), (self._total, sum(self._index.values()))
            assert self.max_bytes is None or self._total <= self.max_bytes or len(self._index) <= 1
            for key, size in self._index.items():
                assert self.path_of(key).stat().st_size == size, key.hex()


def _key_of(folder: str, name: str) -> bytes | None:
    """The key whose page file is <folder>/<name> (FileTier.path_of), or None where there is
    none: a name that is not the lower-case hex of a key of 1..MAX_KEY_BYTES bytes, or one in
    another key's folder. Such a file, indexed under the key its name spells, would be
    counted again beside the key's own file and never removed by its delete or eviction."""
    try:
        key = bytes.fromhex(name.removesuffix(PAGE_SUFFIX))
    except ValueError:
        return None
    if not key or len(key) > fmt.MAX_KEY_BYTES:
        return None
    h = key.hex()
    return key if (folder, name) == (h[:2], h + PAGE_SUFFIX) else None


def remove_file(path: str | os.PathLike[str]) -> bool:
    """Remove a file; False if it was not there. Other errors are logged, never raised (a
    tier never raises): the file stays on disk, uncounted, until the next start's scan."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("file tier: cannot remove %s: %s", path, e)
        return False
