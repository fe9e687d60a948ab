"""Memory an engine shares by file descriptor (memfd segments, which have no /dev/shm name):
the engine sends the fds over a Unix socket beside the sidecar's (SCM_RIGHTS), the sidecar
keeps them under random ids, and a registration names the ids. Several segments (SGLang's
K and V buffers are two memfds) map back to back into one flat buffer, each at an offset
rounded up to the mmap granularity (segment_offsets).

Only a peer of the sidecar's own uid may send fds (SO_PEERCRED); an id not claimed within
`ttl_s` is closed.
"""

from __future__ import annotations

import array
import ctypes
import json
import mmap
import os
import secrets
import socket
import stat
import threading
import time
from collections import Counter
from collections.abc import Sequence

from hicache.memory.buffer import MemoryHandle, SharedBuffer, seal_shrink, shrunk
from hicache.memory.vm import MAP_FIXED, PROT_NONE, drop_mapping, libc_mmap, munmap

MAX_FDS = 16
_MAGIC = b"HCFD1"


def fd_socket_path(sidecar_socket: str) -> str:
    """Where a sidecar listening on `sidecar_socket` takes fds."""
    return sidecar_socket + ".fd"


def segment_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each segment of `sizes` bytes starts when mapped back to back, and the total."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    return offsets, at


def fd_sizes(fds: Sequence[int]) -> list[int]:
    """Each fd's size; ValueError unless every one is a regular file (memfd, shm) of > 0 bytes."""
    sizes = []
    for fd in fds:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
            raise ValueError(f"fd {fd} is not a non-empty regular file (memfd or shared memory)")
        sizes.append(st.st_size)
    return sizes


def send_fds(sidecar_socket: str, fds: Sequence[int], timeout: float = 10.0) -> list[str]:
    """Hand `fds` to the sidecar on `sidecar_socket`; returns their ids for a MemoryHandle of
    kind "fd". Waits up to `timeout` s for a sidecar that is starting. Raises OSError when
    the sidecar does not take them."""
    if not 1 <= len(fds) <= MAX_FDS:
        raise ValueError(f"send 1 to {MAX_FDS} fds, got {len(fds)}")
    fd_sizes(fds)
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        while True:
            try:
                s.connect(fd_socket_path(sidecar_socket))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        s.sendmsg([_MAGIC], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        reply = s.makefile("rb").readline()
    answer = json.loads(reply or b"{}")
    if "ids" not in answer:
        raise OSError(f"the sidecar refused the fds: {answer.get('error', 'no answer')}")
    return list(answer["ids"])


class FdStore:
    """Fds received from engines, by id, until a registration claims them. Thread-safe."""

    def __init__(self, ttl_s: float = 120.0):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._fds: dict[str, tuple[int, float]] = {}

    def add(self, fd: int) -> str:
        fid = "fd-" + secrets.token_hex(12)
        with self._lock:
            self._expire_locked()
            self._fds[fid] = (fd, time.monotonic() + self.ttl_s)
        return fid

    def take(self, ids: Sequence[str]) -> list[int]:
        """The fds of `ids`, now the caller's to close. ValueError, taking none, for an id
        that is unknown, expired or given twice."""
        repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
        if repeated:
            raise ValueError(f"fd id(s) {repeated} given more than once: name each fd once")
        with self._lock:
            self._expire_locked()
            missing = [i for i in ids if i not in self._fds]
            if missing or not ids:
                raise ValueError(f"unknown or expired fd id(s) {missing or list(ids)}: send the fds again")
            return [self._fds.pop(i)[0] for i in ids]

    def expire(self) -> int:
        """Close the fds not claimed within ttl_s; returns how many. add() and take() do it
        too, but an engine that dies before it registers leaves nobody to call them: the
        server's reaper calls this."""
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        now = time.monotonic()
        expired = [f for f, (_, deadline) in self._fds.items() if deadline < now]
        for fid in expired:
            os.close(self._fds.pop(fid)[0])
        return len(expired)

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


class FdListener:
    """The socket engines send fds to, and the thread that answers them (serve_fds)."""

    def __init__(self, listener: socket.socket, thread: threading.Thread):
        self.socket, self.thread = listener, thread

    def close(self) -> None:
        """Stop taking fds and wait for the thread (close() alone does not wake accept())."""
        try:
            self.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already
        self.socket.close()
        if self.thread is not threading.current_thread():
            self.thread.join()


def serve_fds(path: str, store: FdStore) -> FdListener:
    """Listen on `path` (mode 0600) for engines' fds; a thread answers each connection with
    the ids of the fds it sent. Close the returned listener to stop."""
    if os.path.exists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
        listener.listen(16)
    except BaseException:
        listener.close()
        raise
    finally:
        os.umask(old)

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # shut down
            with conn:
                conn.settimeout(5.0)
                try:
                    _answer(conn, store)
                except OSError:
                    pass

    thread = threading.Thread(target=loop, name="hicache-fd-listener", daemon=True)
    thread.start()
    return FdListener(listener, thread)


def _answer(conn: socket.socket, store: FdStore) -> None:
    uid = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    peer_uid = int.from_bytes(uid[4:8], "little")
    # close-on-exec as they arrive: a process the sidecar starts must not inherit the engine's memory
    msg, anc, _, _ = conn.recvmsg(len(_MAGIC), socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % 4])
    try:
        if peer_uid != os.getuid():
            raise ValueError(f"peer uid {peer_uid} is not the sidecar's uid {os.getuid()}")
        if msg != _MAGIC or not fds:
            raise ValueError("expected the hicache fd message with at least one fd")
        fd_sizes(fds)
    except (ValueError, OSError) as exc:
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"error": str(exc)}).encode() + b"\n")
        return
    conn.sendall(json.dumps({"ids": [store.add(fd) for fd in fds]}).encode() + b"\n")


def map_fds(fds: Sequence[int], handle: MemoryHandle) -> tuple[SharedBuffer, list[int], list[int]]:
    """Map `fds` back to back as one flat buffer; returns it, where each segment starts in it
    (segment_offsets) and each segment's size (the bytes of it that exist: the rest of its last
    page is not the file's); takes ownership of the fds. Raises ValueError if their sizes do
    not add up to handle.nbytes."""
    try:
        sizes = fd_sizes(fds)
        _, total = segment_offsets(sizes)
        if total != handle.nbytes:
            raise ValueError(f"fd segments of {sizes} bytes map to {total} bytes, the handle says {handle.nbytes}")
        base = libc_mmap(None, total, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        offsets, _ = segment_offsets(sizes)
        for fd, off, size in zip(fds, offsets, sizes, strict=True):
            try:
                libc_mmap(base + off, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
            except OSError:
                munmap(base, total)
                raise
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    # memfds are sealed against shrinking where the engine allowed sealing; the others stay
    # open so that each transfer first checks their size (a shrunk file would fault: SIGBUS)
    watched = [(fd, size) for fd, size in zip(fds, sizes, strict=True) if not seal_shrink(fd)]
    kept = [fd for fd, _ in watched]
    for fd in fds:
        if fd not in kept:
            os.close(fd)

    def release() -> None:  # the tensor does not own the mapping: a stale access would fault
        drop_mapping(base, total)
        for fd in kept:
            os.close(fd)

    damage = shrunk(kept, [size for _, size in watched], "the engine's memory (fd)") if kept else None
    import torch  # here, not at import: a sidecar starts without torch

    tensor = torch.frombuffer((ctypes.c_uint8 * total).from_address(base), dtype=torch.uint8)
    return SharedBuffer(tensor, handle, release, damage), offsets, sizes
