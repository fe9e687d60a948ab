"""The file tier's read path: a page file read into a buffer or straight into a page's
pieces, checked (a regular file of the page's size) and verified before it is served.

A miss, a file that is missing, a symlink, FIFO or file of another size in place of a page,
and a page that fails verification are all served as misses; a bad file is deleted and
counted. FileReads is a base of FileTier (file.py), which does the read into pieces
(_read_into) and keeps the read order (_note_read).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from hicache.storage import page_format as fmt
from hicache.storage.base import check_pieces
from hicache.storage.file_index import FileIndex
from hicache.storage.lazy_threads import LazyThreads

R = TypeVar("R")


class FileReads(FileIndex):
    """get, batch_read and batch_read_into of a file tier."""

    read_threads: int
    _readers: LazyThreads  # batch_read_into's
    _buffers: threading.local  # each thread's reused page buffer (batch_read)

    def get(self, key: bytes) -> memoryview | None:
        fmt.check_key(key)
        buf = bytearray(fmt.stored_size(self.identity, key))
        return self._read(key, memoryview(buf))

    def batch_read(self, keys: Sequence[bytes], sink: Callable[[int, memoryview], None]) -> int:
        """batch_get's prefix, each page read into this thread's reused buffer: no
        allocation (and no page faults on fresh memory) per page."""
        n = 0
        for key in keys:
            fmt.check_key(key)
            size = fmt.stored_size(self.identity, key)
            buf = getattr(self._buffers, "page", None)
            if buf is None or len(buf) < size:
                buf = self._buffers.page = bytearray(size)
            payload = self._read(key, memoryview(buf)[:size])
            if payload is None:
                break
            sink(n, payload)
            n += 1
        return n

    def batch_read_into(self, keys: Sequence[bytes], pieces_of: Callable[[int], Sequence[memoryview]]) -> int:
        """batch_read straight into each page's pieces: one preadv per file (header + key
        into a small buffer, the payload into the pieces), verified over the pieces. No
        buffer in between, so the payload is copied once, by the kernel. Up to read_threads
        files are read at once; the keys and pieces are all checked before any is read. The
        pages after the first miss may have been read too (and counted as hits): their pieces,
        like the miss's, may hold any bytes."""
        for key in keys:
            fmt.check_key(key)
        pieces = [check_pieces(pieces_of(i), self.identity.page_bytes) for i in range(len(keys))]
        if self.read_threads == 1 or len(keys) < 2:
            n = 0
            while n < len(keys) and self._read_into(keys[n], pieces[n]):
                n += 1
            return n
        found = list(self._readers.get().map(self._read_into, keys, pieces))
        return found.index(False) if False in found else len(found)

    @abstractmethod
    def _read_into(self, key: bytes, pieces: Sequence[memoryview]) -> bool:
        """Read `key`'s page straight into `pieces` (their lengths add up to page_bytes) and
        verify it; False for a miss (FileTier: one preadv per file where it can)."""

    def _read(self, key: bytes, buf: memoryview) -> memoryview | None:
        """The page of `key` read into `buf` (its stored size), verified: its payload, or
        None for a miss (a bad file is deleted and counted, as get() documents)."""
        return self._load(
            key, buf.nbytes, lambda fd: os.readv(fd, [buf]), lambda got: fmt.decode_page(self.identity, key, buf[:got])
        )

    def _load(self, key: bytes, size: int, read: Callable[[int], int], verify: Callable[[int], R]) -> R | None:
        """The read of one page file: checks it is a regular file of `size` bytes, then
        read(fd) -> bytes read, then verify(bytes read) -> the result (PageError for a bad
        page). A miss, or a bad file (deleted and counted, as get() documents), is None."""
        with self._lock:
            known = key in self._index
        if not known:
            self._count(misses=1)
            return None
        path = self.path_of(key)
        try:
            # O_NONBLOCK: a FIFO put in place of a page opens at once (and is refused below)
            # instead of blocking the read; O_NOFOLLOW: a symlink fails with ELOOP
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            self._open_failed(key, path, e)
            return None
        try:  # the file stays open until it is verified: its inode cannot be reused meanwhile
            result = self._read_open(key, path, fd, size, read, verify)
        finally:
            os.close(fd)
        if result is None:
            return None
        self._note_read(key)
        self._count(hits=1, bytes_read=self.identity.page_bytes)
        return result

    @abstractmethod
    def _note_read(self, key: bytes) -> None:
        """A page of `key` was served: it is now the most recent (FileTier keeps the order)."""

    def _read_open(
        self, key: bytes, path: Path, fd: int, size: int, read: Callable[[int], int], verify: Callable[[int], R]
    ) -> R | None:
        """_load's checks, read and verification of the open page file `fd`; None for a miss."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:  # checked before reading
                why = f"{path}: not a regular file of {size} bytes (mode {st.st_mode:o}, size {st.st_size})"
                self._refuse(key, path, st, why)
                return None
            got = read(fd)
        except OSError as e:
            self._error(f"read {path}: {e}")
            self._count(misses=1)
            return None
        try:
            return verify(got)
        except fmt.PageError as e:
            if e.reason == "unreadable":  # this process lacks the checksum algorithm: keep it
                self._error(str(e))
                self._count(misses=1)
            else:
                self._drop(key, path, st)
                self._count(misses=1, **{e.reason: 1})
            return None

    def _open_failed(self, key: bytes, path: Path, e: OSError) -> None:
        """_load's open of `path` failed with `e`: a miss, and a symlink in place of the page is refused."""
        if isinstance(e, FileNotFoundError):  # evicted or deleted meanwhile
            with self._lock:  # a rewrite since then renames and indexes under this lock
                if key in self._index and not path.exists():
                    self._remove_locked(key, path)
            self._count(misses=1)
            return
        if e.errno == errno.ELOOP:
            try:
                st = os.lstat(path)
            except OSError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):  # not a page written since
                self._refuse(key, path, st, f"{path} is a symlink")
                return
        else:
            self._error(f"read {path}: {e}")
        self._count(misses=1)
