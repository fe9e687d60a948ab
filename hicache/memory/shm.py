"""POSIX shared memory: segments under /dev/shm (mode 0600, unpredictable names), created,
mapped by name in another process, and unlinked on close, at exit and on SIGTERM.

A segment's name says who made it: hicache-<pid namespace>-<pid>-<start time>-<tag>, where
the tag is 96 bits of a hash of the name's head and a 128-bit proof that only the creating
process holds (MemoryHandle.proof). Presenting the proof shows that the caller made the
segment: the sidecar maps a segment an engine names only with it (owns_shm). A process killed with SIGKILL cannot unlink its segments, so sweep_dead_segments()
(run by the sidecar at start-up and at each registration) removes those whose owner, in
this pid namespace, is gone; owners in other pid namespaces (other containers sharing the
IPC namespace) are never judged.

Only the process that created a segment unlinks it: a forked child inherits the parent's
finalizers and SIGTERM handler, and must leave the parent's live segments alone."""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import re
import secrets
import signal
import stat
import tempfile
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hicache.memory.buffer import MemoryHandle, SharedBuffer, check_nbytes, shrunk
from hicache.memory.vm import drop_mapping, map_read_only, punch_holes, punch_path

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
SHM_PREFIX = "hicache-"
_OWNED_RE = re.compile(r"^hicache-(\d+)-(\d+)-(\d+)-[0-9a-f]{24}$")


def shm_dir() -> str:
    """Directory that backs POSIX shared memory (/dev/shm on Linux)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def create_shm(
    nbytes: int, committed: Sequence[tuple[int, int]] | None = None, *, free_on_close: bool = True
) -> SharedBuffer:
    """Create a new shared-memory segment, mode 0600 (whatever the umask), with an
    unpredictable name (96 random bits), unlinked on close, at exit, and on a SIGTERM the
    process does not handle itself (see _unlink_on_sigterm). Its memory is allocated (and
    faulted in) now: all of it, or only the `committed` (offset, length) ranges, the rest
    left sparse until commit_shm. On close its memory is freed at once, even where other
    processes still map it (they read zeros), unless free_on_close is False (then it goes
    with the last mapping)."""
    check_nbytes(nbytes)
    spans = [(0, nbytes)] if committed is None else list(committed)
    ns, pid, start = _owner()
    head, proof = f"{SHM_PREFIX}{ns}-{pid}-{start}", secrets.token_hex(16)
    name = f"{head}-{_tag(head, proof)}"
    path = os.path.join(shm_dir(), name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly owner read/write, whatever the umask
        os.ftruncate(fd, nbytes)
        for offset, length in spans:
            _reserve(fd, length, offset)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    os.close(fd)
    creator = os.getpid()
    _LIVE_SEGMENTS[path] = creator
    _unlink_on_sigterm()
    try:
        import torch  # here, not at import: a sidecar starts without torch

        tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        for offset, length in spans:
            tensor[offset : offset + length].zero_()  # fault the pages in now, not on the first transfer
    except BaseException:
        _release_segment(path, creator, nbytes)
        raise
    handle = MemoryHandle("shm", nbytes, name=name, proof=proof)
    base = tensor.data_ptr()

    def release() -> None:
        _release_segment(path, creator, nbytes if free_on_close else 0)
        if os.getpid() == creator:
            drop_mapping(base, nbytes)

    return SharedBuffer(tensor, handle, release)


def _tag(head: str, proof: str) -> str:
    return hashlib.sha256(f"hicache-shm-proof\0{head}\0{proof}".encode()).hexdigest()[:24]


def owns_shm(name: str, proof: str) -> bool:
    """Whether `proof` is the proof of the segment named `name`: the caller made it with
    create_shm (or was handed the proof by the process that did). Reads no file, so the
    answer says nothing about which segments exist."""
    m = _OWNED_RE.match(name) if isinstance(name, str) else None
    if m is None or not isinstance(proof, str) or not proof:
        return False
    head, tag = name.rsplit("-", 1)
    return hmac.compare_digest(tag, _tag(head, proof))


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat_line = f.read()
    except OSError:
        return None
    return int(stat_line.rsplit(")", 1)[1].split()[19])  # fields after "(comm)" start at 3


def _owner() -> tuple[int, int, int]:
    pid = os.getpid()
    return _pid_namespace(), pid, _start_time(pid) or 0


def sweep_dead_segments() -> list[str]:
    """Unlink the segments of processes of this pid namespace that are gone (killed before
    they could unlink them); returns their names. A pid reused by a newer process has another
    start time, so its predecessor's segments go too. A segment this process may not remove
    (another uid's, in a sticky /dev/shm) is skipped. Never raises."""
    ns = _pid_namespace()
    if not ns:
        return []
    removed = []
    try:
        names = os.listdir(shm_dir())
    except OSError:
        return []
    for name in names:
        m = _OWNED_RE.match(name)
        if not m or int(m.group(1)) != ns:
            continue
        pid, start = int(m.group(2)), int(m.group(3))
        if _start_time(pid) == start:
            continue
        try:
            os.unlink(os.path.join(shm_dir(), name))
        except FileNotFoundError:
            continue  # another sweeper was first
        except OSError as exc:
            log.debug("cannot remove dead shared memory %s: %s", name, exc.strerror)
            continue
        removed.append(name)
    return removed


def commit_shm(name: str, spans: Sequence[tuple[int, int]]) -> None:
    """Allocate the (offset, length) ranges of this process's segment `name` (as create_shm
    does). Raises OSError ENOSPC when they do not fit."""
    fd = os.open(os.path.join(shm_dir(), name), os.O_RDWR)
    try:
        for offset, length in spans:
            _reserve(fd, length, offset)
    finally:
        os.close(fd)


def release_shm(name: str, spans: Sequence[tuple[int, int]]) -> bool:
    """Give the memory of the (offset, length) ranges of segment `name` back to the system
    (they read as zeros after). False where the file system cannot (the bytes stay)."""
    fd = os.open(os.path.join(shm_dir(), name), os.O_RDWR)
    try:
        return punch_holes(fd, list(spans))
    finally:
        os.close(fd)


def _reserve(fd: int, nbytes: int, offset: int = 0) -> None:
    """Allocate the segment's pages now, so that a full tmpfs fails here with OSError ENOSPC
    instead of a SIGBUS when a page is first touched (Docker's default /dev/shm is 64 MiB).
    A file system without fallocate is left to the zeroing that follows."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return
        raise OSError(
            exc.errno, f"shared memory of {nbytes} bytes does not fit in {shm_dir()}: {exc.strerror}"
        ) from None


# Segments not unlinked yet, by path, with the pid of the process that created them (a forked
# child inherits this and must leave its parent's alone). A dict's set/pop/copy are atomic
# under the GIL, so the SIGTERM handler reads it without a lock (a lock could deadlock there).
_LIVE_SEGMENTS: dict[str, int] = {}


def _release_segment(path: str, creator: int, nbytes: int) -> None:
    """Free (its first `nbytes`) and unlink the segment at `path` if this process is its
    `creator`: that memory goes back at once, even while other processes (or a stale tensor
    here) still map it. A forked child's finalizer for its parent's segment does nothing."""
    if os.getpid() != creator:
        return
    _LIVE_SEGMENTS.pop(path, None)
    if nbytes:
        punch_path(path, nbytes)
    _unlink(path)


def _unlink_on_sigterm() -> None:
    """Make SIGTERM unlink this process's segments before it dies. Installed only where
    SIGTERM still has its default action (the process would die without running atexit or
    finalizers): a process with its own handler (the sidecar) shuts down through it instead.
    After unlinking, the default action runs, so the exit status is still "killed by SIGTERM"."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: object) -> None:
        me = os.getpid()
        for path, creator in list(_LIVE_SEGMENTS.items()):
            if creator == me:
                _unlink(path)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def open_shm(name: str, nbytes: int, *, read_only: bool = False) -> SharedBuffer:
    """Map an existing segment created by create_shm in another process; `read_only` maps
    it for reading only (a write through the tensor faults: SIGSEGV).

    Raises ValueError for a malformed name or a size mismatch, FileNotFoundError if absent.
    """
    check_nbytes(nbytes)
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"invalid shared-memory name {name!r}")
    path = os.path.join(shm_dir(), name)
    flags = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:  # O_NOFOLLOW: a symlink planted to map some other file fails here (ELOOP)
        fd = os.open(path, flags)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"shared memory {name!r} cannot be opened as a plain file: {exc.strerror}") from None
    try:
        st = os.fstat(fd)  # checks and maps this very file, whatever the name points to by then
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"shared memory {name!r} is not a regular file")
        if st.st_size != nbytes:
            raise ValueError(f"shared memory {name!r} holds {st.st_size} bytes, expected {nbytes}")
        tensor = map_read_only(fd, nbytes) if read_only else _map_shared(fd, path, nbytes)
    except BaseException:
        os.close(fd)
        raise
    # the fd stays open so that a transfer can first check that the owner has not shrunk it
    damage = shrunk([fd], [nbytes], f"shared memory {name!r}")
    base = tensor.data_ptr()

    def release() -> None:
        drop_mapping(base, nbytes)
        os.close(fd)

    return SharedBuffer(tensor, MemoryHandle("shm", nbytes, name=name), release, damage)


def _map_shared(fd: int, path: str, nbytes: int) -> torch.Tensor:
    import torch

    source = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path  # Linux: the open file
    return torch.from_file(source, shared=True, size=nbytes, dtype=torch.uint8)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
