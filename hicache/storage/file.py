"""The file tier: one file per page in a local directory, with a size cap and LRU eviction.

Layout: <dir>/<identity qualifier>/<first 2 hex digits of key>/<key hex>.page, each file a
page in page_format. FileTier is put together from its index (file_index: the scan on start,
removal, eviction under the cap, status), its read path (file_reads) and its write path
(file_writes: a page is acknowledged only once it is complete and durable). This module
holds its options, its folder, the read order, and the system calls on page files: the
gathered write of a temporary file, the read of a page file into a page's pieces, syncfs.
The read order is written to the files' modification times every RECENCY_BATCH reads (on a
thread of its own) and at close.

One process owns one (dir, identity) folder (make_tier hands pools of one identity the same
FileTier); machines share pages through Redis instead.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from hicache.storage import page_format as fmt
from hicache.storage.base import Buffer, Payload, TierIdentity, skip_done
from hicache.storage.file_index import remove_file
from hicache.storage.file_reads import FileReads
from hicache.storage.file_writes import FileWrites
from hicache.storage.lazy_threads import LazyThreads
from hicache.validate import is_int

IOV_MAX = max(0, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 0) or 1024  # buffers per preadv


# Reads in flight per batch_read_into. From a disk, what helps is queue depth, not cores
# (2-core VM, 256 MiMo pages after drop_caches: 1.0 GB/s on 1 thread, 1.5-1.6 on 4, 1.7 on 8);
# from the page cache they are at par with one thread here (the checksum holds the GIL).
DEFAULT_READ_THREADS = 4
# No flush by default: a page a machine crash lost is a miss, one it tore fails its checksum
# (docs/storage-tiers.md); an fsync per page made the tier fall behind any burst.
DEFAULT_FSYNC = False


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


class FileTier(FileReads, FileWrites):
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
        fsync: bool | str = DEFAULT_FSYNC,
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

    # ---- the read of a page file into its pieces, and the read order ----------------------------
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

    def _note_read(self, key: bytes) -> None:
        """A page of `key` was served: it moves to the recent end of the index, and joins the
        reads whose order persist_recency writes (on a thread of its own every RECENCY_BATCH
        reads)."""
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

    # ---- users and close ------------------------------------------------------------------------
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

    # ---- the write path's system calls ----------------------------------------------------------
    def _write_tmp(self, tmp: Path, header: bytes, data: Payload) -> os.stat_result | None:
        """Write the temporary file `tmp`; its stat (which names the page's inode once
        renamed), or None where the write failed (counted)."""
        try:
            tmp.parent.mkdir(exist_ok=True)
            write_file(tmp, [header, *fmt.payload_parts(data)], self.fsync is True)
            return os.stat(tmp)
        except OSError as e:
            remove_file(tmp)
            self._failed(e, f"write {tmp}")
            return None

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
