"""The file tier's write path: a batch of pages written, renamed into place, indexed and
flushed, each page acknowledged only once it is durable.

A write goes to a temporary file in the same folder, is fsynced (unless fsync=False), then
renamed over the final name, and the folder is fsynced (the first time a page lands in a new
shard folder, the root too, which holds that folder's entry; the root's own entry is fsynced
at start): a page is acknowledged only once it is complete and durable, and a crash leaves
at most a temporary file, which the next start deletes. With fsync="batch" (group commit), a
batch's files are written and renamed without a flush each, then one syncfs of the file
system makes the data and the renames durable together before the batch is acknowledged: the
same rule (acknowledged means durable) at one flush per batch; a crash before that flush can
leave a renamed page without its data, which the start's scan drops (its size) or a read
refuses (its checksum), never serves. A flush that fails (a folder's fsync, or the batch's
syncfs) acknowledges none of the pages it covers: set() returns False for them, and they are
taken back (deleted, unindexed, watchers told "removed", counted as write failures), so a
page set() refused is never served.

FileWrites is a base of FileTier (file.py), which writes the temporary file (_write_tmp) and
does the syncfs (_syncfs).
"""

from __future__ import annotations

import errno
import os
import threading
from abc import abstractmethod
from collections.abc import Collection, Sequence
from pathlib import Path

from hicache.storage import page_format as fmt
from hicache.storage.base import Payload
from hicache.storage.file_index import TMP_SUFFIX, FileIndex, remove_file

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class FileWrites(FileIndex):
    """set and batch_set of a file tier."""

    def set(self, key: bytes, data: Payload) -> bool:
        return self.batch_set([(key, data)])[0]

    def batch_set(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]:
        headers = [fmt.encode_header(self.identity, key, data) for key, data in items]  # validates all first
        cap = self.max_bytes
        too_big = [cap is not None and fmt.stored_size(self.identity, key) > cap for key, _ in items]
        if any(too_big):  # a page larger than the whole cap (its key is part of its size) is refused
            self._count(write_failures=sum(too_big), no_space=sum(too_big))
        with self._stats_lock:
            no_space_before = self._counters.no_space
        written: list[tuple[int, Path, Path, os.stat_result]] = []  # (item index, tmp, final, tmp's stat)
        ok = [False] * len(items)
        for i, ((key, data), header) in enumerate(zip(items, headers, strict=True)):
            if too_big[i]:
                continue
            final = self.path_of(key)
            tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.{i}{TMP_SUFFIX}")
            if (seen := self._write_tmp(tmp, header, data)) is not None:
                written.append((i, tmp, final, seen))
        dirs: set[Path] = set()
        failures: list[tuple[OSError, Path]] = []
        with self._lock:  # rename and index together, so a delete or eviction never splits them
            for i, tmp, final, _ in written:
                try:
                    os.replace(tmp, final)
                except OSError as e:
                    remove_file(tmp)
                    failures.append((e, tmp))
                    continue
                dirs.add(final.parent)
                ok[i] = True
                key = items[i][0]
                size = fmt.stored_size(self.identity, key)
                self._total += size - self._index.pop(key, 0)
                self._index[key] = size
            # under the lock, before the evictions below: events keep the order of the changes
            self._changed("stored", [items[i][0] for i, _, _, _ in written if ok[i]])
            for i, _, _, _ in written:
                if ok[i]:
                    self._evict_locked(keep=items[i][0])
        for error, tmp in failures:
            self._failed(error, f"rename {tmp}")
        unflushed = self._flush(dirs)
        taken_back = [(i, final, seen) for i, _, final, seen in written if ok[i] and final.parent in unflushed]
        if taken_back:  # not durable, so not acknowledged, and not served either
            self._take_back([(items[i][0], final, seen) for i, final, seen in taken_back])
            for i, _, _ in taken_back:
                ok[i] = False
        n_ok = sum(ok)
        with self._stats_lock:
            full_now = self._counters.no_space > no_space_before
        if n_ok or full_now:
            self._disk_full = full_now
        self._count(writes=n_ok, bytes_written=n_ok * self.identity.page_bytes)
        return ok

    @abstractmethod
    def _write_tmp(self, tmp: Path, header: bytes, data: Payload) -> os.stat_result | None:
        """Write the temporary file `tmp` (FileTier); its stat, or None where the write failed
        (counted)."""

    def _failed(self, e: OSError, what: str) -> None:
        self._count(write_failures=1, no_space=int(e.errno in _NO_SPACE))
        self._error(f"{what}: {e}")

    def _flush(self, dirs: Collection[Path]) -> frozenset[Path]:
        """Make the pages just renamed into `dirs` durable as `fsync` says: the folders whose
        flush failed (all of them when the batch's syncfs failed)."""
        if not dirs or not self.fsync:
            return frozenset()
        if self.fsync == "batch":
            return frozenset() if self._syncfs() else frozenset(dirs)
        failed = set()
        for d in dirs:
            if not self._fsync_dir(d):
                failed.add(d)
            elif d not in self._durable_dirs:  # a new shard folder: its entry in the root too
                if self._fsync_dir(d.parent):
                    self._durable_dirs.add(d)
                else:
                    failed.add(d)
        return frozenset(failed)

    def _take_back(self, pages: list[tuple[bytes, Path, os.stat_result]]) -> None:
        """Pages (key, path, stat when written) whose flush failed: each is deleted and
        unindexed, watchers told "removed", unless a later write has replaced it; all are
        counted as write failures."""
        with self._lock:
            for key, path, seen in pages:
                self._drop_locked(key, path, seen)
        self._count(write_failures=len(pages))

    @abstractmethod
    def _syncfs(self) -> bool:
        """The group commit's one syncfs (FileTier); False (counted as an error) when it failed."""

    def _fsync_dir(self, d: Path) -> bool:
        """fsync the folder `d` (the renames into it); False (counted as an error) when it failed."""
        try:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return True
        except OSError as e:
            self._error(f"fsync {d}: {e}")
            return False
