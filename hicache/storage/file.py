"""The file tier: one file per page in a local directory, with a size cap and LRU eviction.

Layout: <dir>/<identity qualifier>/<first 2 hex digits of key>/<key hex>.page, each file a
page in page_format. A write goes to a temporary file in the same folder, is fsynced
(unless fsync=False), then renamed over the final name, and the folder is fsynced (the
first time a page lands in a new shard folder, the root too, which holds that folder's
entry; the root's own entry is fsynced at start): a page is acknowledged only once it is
complete and durable, and a crash leaves at most a temporary file, which the next start
deletes. With fsync="batch" (group commit), a batch's files are written and renamed
without a flush each, then one syncfs of the file system makes the data and the renames
durable together before the batch is acknowledged: the same rule (acknowledged means
durable) at one flush per batch; a crash before that flush can leave a renamed page without
its data, which the start's scan drops (its size) or a read refuses (its checksum), never
serves. A flush that fails (a folder's fsync, or the batch's
syncfs) acknowledges none of the pages it covers: set() returns False for them, and they
are taken back (deleted, unindexed, watchers told "removed", counted as write failures), so
a page set() refused is never served. The index (key -> size, in LRU order) lives in
memory and is rebuilt by scanning the folder on start, oldest modification first; a file
that is not the page file of the key its name spells (another folder, upper-case hex) is
deleted and counted corrupt. The read order is written to the files' modification times
every RECENCY_BATCH reads (on a thread of its own) and at close.

One process owns one (dir, identity) folder (make_tier hands pools of one identity the same
FileTier); machines share pages through Redis instead.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TypeVar

from hicache.storage import page_format as fmt
from hicache.storage.base import (
    Buffer,
    LazyThreads,
    Payload,
    StorageTier,
    TierHealth,
    TierIdentity,
    TierStats,
    check_pieces,
    skip_done,
)
from hicache.validate import is_int

log = logging.getLogger(__name__)

PAGE_SUFFIX = ".page"
TMP_SUFFIX = ".tmp"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
IOV_MAX = max(0, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 0) or 1024  # buffers per preadv
R = TypeVar("R")


# Reads in flight per batch_read_into. From a disk, what helps is queue depth, not cores
# (2-core VM, 256 MiMo pages after drop_caches: 1.0 GB/s on 1 thread, 1.5-1.6 on 4, 1.7 on 8);
# from the page cache they are at par with one thread here (the checksum holds the GIL).
DEFAULT_READ_THREADS = 4


def check_options(
    directory: object, max_bytes: object, fsync: object, read_threads: object = DEFAULT_READ_THREADS
) -> None:
    """Raise ValueError naming the first bad FileTier option (also used to check a sidecar's
    extra config at start-up, before any pool registers)."""
    if not isinstance(directory, str | os.PathLike):
        raise ValueError(f"file tier dir must be a path, got {directory!r}")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"file tier dir {os.fspath(directory)!r} exists and is not a folder")
    if max_bytes is not None and (not is_int(max_bytes) or max_bytes < 1):
        raise ValueError(f"max_bytes must be an int >= 1 or None, got {max_bytes!r}")
    if not isinstance(fsync, bool) and fsync != "batch":
        raise ValueError(f'file tier "fsync" must be true, false or "batch", got {fsync!r}')
    if not is_int(read_threads) or not 1 <= read_threads <= 64:
        raise ValueError(f'file tier "read_threads" must be an int from 1 to 64, got {read_threads!r}')


RECENCY_BATCH = 1024  # reads between two writes of the read order to the files' mtimes


class FileTier(StorageTier):
    """Pages of `identity` under `directory`, at most `max_bytes` of page files (None: no cap).

    batch_read_into reads up to `read_threads` page files at once (default 4): a disk serves
    several reads in flight faster than one after another.

    Raises ValueError for a bad max_bytes or read_threads, OSError if the folder cannot be
    created.
    """

    backend = "file"

    def __init__(
        self,
        identity: TierIdentity,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        fsync: bool | str = True,
        read_threads: int = DEFAULT_READ_THREADS,
    ):
        super().__init__(identity)
        check_options(directory, max_bytes, fsync, read_threads)
        self.root = Path(directory) / identity.qualifier
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._lock = threading.Lock()  # guards _index and _total; held for index changes and unlinks
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recent first
        self._total = 0
        self._disk_full = False  # the last batch hit ENOSPC; cleared by a batch that did not
        self._read_since: OrderedDict[bytes, None] = OrderedDict()  # read, recency not yet on disk
        self._persister: threading.Thread | None = None  # writes the read order, off the read path
        self._buffers = threading.local()  # each thread's reused page buffer (batch_read)
        self.read_threads = read_threads
        self._readers = LazyThreads(read_threads, "hicache-file-read")  # batch_read_into's
        self._users = 1  # share() adds one, close() takes one: the last close releases
        self._make_root()
        # shard folders whose own entry in root is known durable (fsync True: the root is
        # fsynced once after a new one is made, before its first page is acknowledged); _scan
        # adds those the root holds at start
        self._durable_dirs: set[Path] = set()
        self._scan()

    def _make_root(self) -> None:
        """Create the root folder; with fsync, fsync it (the shard folders it holds) and the
        parent of each folder made on the way (their new entries). A failed fsync is
        counted and logged, as a write's is."""
        made = []
        for folder in (self.root, *self.root.parents):
            if folder.exists():
                break
            made.append(folder)
        self.root.mkdir(parents=True, exist_ok=True)
        if self.fsync is True:  # "batch": each batch's syncfs covers these entries too
            for folder in (self.root, *(m.parent for m in made)):
                self._fsync_dir(folder)

    # ---- paths and scanning -----------------------------------------------------------------
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
                    _unlink(entry.path)
                    continue
                if not entry.name.endswith(PAGE_SUFFIX):
                    continue
                key = _key_of(sub.name, entry.name)
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if key is None or not stat.S_ISREG(st.st_mode) or st.st_size != fmt.stored_size(self.identity, key):
                    _unlink(entry.path)
                    self._count(corrupt=1)
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._total += size
            self._evict_locked(keep=None)

    # ---- reads --------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        fmt.check_key(key)
        with self._lock:
            return key in self._index

    def batch_contains(self, keys: Sequence[bytes]) -> list[bool]:
        for key in keys:
            fmt.check_key(key)
        with self._lock:
            return [k in self._index for k in keys]

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

    def _read_into(self, key: bytes, pieces: Sequence[memoryview]) -> bool:
        head = memoryview(bytearray(fmt.HEADER_BYTES + len(key)))
        size = head.nbytes + self.identity.page_bytes
        checksum: list[int | None] = [None]  # computed as the payload was read, where it can be

        def read(fd: int) -> int:
            got = os.preadv(fd, [head], 0)
            if got < head.nbytes:
                return got
            if (fused := fmt.read_payload_checksummed(fd, head, pieces)) is not None:
                n, checksum[0] = fused
                return got + n
            for at in range(0, len(pieces), IOV_MAX):
                group = pieces[at : at + IOV_MAX]
                n = os.preadv(fd, group, got)
                got += n
                if n < sum(v.nbytes for v in group):  # short (the file changed): the rest would land misplaced
                    break
            return got

        def verify(got: int) -> bool:
            if got != size:
                raise fmt.PageError("corrupt", f"read {got} of {size} bytes")
            fmt.verify_page(self.identity, key, head, pieces, checksum[0])
            return True

        return self._load(key, size, read, verify) is not None

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
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                self._read_since.pop(key, None)
                self._read_since[key] = None
            if len(self._read_since) >= RECENCY_BATCH and not (self._persister and self._persister.is_alive()):
                self._persister = threading.Thread(
                    target=self.persist_recency, name="hicache-file-recency", daemon=True
                )
                self._persister.start()
        self._count(hits=1, bytes_read=self.identity.page_bytes)
        return result

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

    def persist_recency(self) -> None:
        """Write the read order kept in memory to the files' modification times (oldest read
        first), so that the LRU order a restart rebuilds from them includes reads. Runs every
        RECENCY_BATCH reads, on a thread of its own (a read that reaches the count does not
        wait for up to that many utime calls), and at close(); not on every read."""
        with self._lock:
            keys, self._read_since = list(self._read_since), OrderedDict()
        for key in keys:
            try:
                os.utime(self.path_of(key))
            except OSError:
                pass  # evicted or deleted meanwhile

    def share(self) -> bool:
        """One more user of this tier (the factory hands one tier to every pool of a folder
        and identity); close() then releases only once every user has closed. False, and
        no user added, once it is closed."""
        with self._lock:
            if self._users == 0:
                return False
            self._users += 1
            return True

    def close(self) -> None:
        """Release this user's share; the last one persists the read order and stops the
        reader threads (the tier is unusable afterwards)."""
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users:
                return
            persister = self._persister
        if persister is not None:
            persister.join()  # its reads are older than those left: their mtimes come first
        self.persist_recency()
        self._readers.close()

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

    # ---- writes -------------------------------------------------------------------------------
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
                    _unlink(tmp)
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

    def _write_tmp(self, tmp: Path, header: bytes, data: Payload) -> os.stat_result | None:
        """Write the temporary file `tmp`; its stat (which names the page's inode once
        renamed), or None where the write failed (counted)."""
        try:
            tmp.parent.mkdir(exist_ok=True)
            write_file(tmp, [header, *fmt.payload_parts(data)], self.fsync is True)
            return os.stat(tmp)
        except OSError as e:
            _unlink(tmp)
            self._failed(e, f"write {tmp}")
            return None

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

    def _syncfs(self) -> bool:
        """One flush of the whole file system the tier is on (its files' data and the renames):
        the group commit. False (counted as an error) when it failed."""
        try:
            fd = os.open(self.root, os.O_RDONLY)
        except OSError as e:
            self._error(f"syncfs {self.root}: {e}")
            return False
        try:
            if _libc_syncfs(fd) != 0:
                self._error(f"syncfs {self.root}: {os.strerror(ctypes.get_errno())}")
                return False
            return True
        finally:
            os.close(fd)

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

    # ---- removal and eviction -----------------------------------------------------------------
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
        removed = _unlink(path)
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
            _unlink(self.path_of(key))
            self._count(evictions=1)
            evicted.append(key)
        self._changed("removed", evicted)

    # ---- status -------------------------------------------------------------------------------
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


def _libc_syncfs(fd: int) -> int:
    """syncfs(2) through libc (Python's os has no syncfs); where it is missing, a sync(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "syncfs"):
        return int(libc.syncfs(fd))
    os.sync()
    return 0


def write_file(path: Path, parts: list[Buffer], fsync: bool) -> None:
    """Create `path` holding the concatenated parts, written gathered (writev, up to IOV_MAX
    parts a call: a host page's pieces cost one call, not one each); fsync it if asked.
    Raises OSError."""
    views = [memoryview(p).cast("B") for p in parts]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        at = 0
        while at < len(views):
            at = skip_done(views, at, os.writev(fd, views[at : at + IOV_MAX]))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


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


def _unlink(path: str | os.PathLike[str]) -> bool:
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
