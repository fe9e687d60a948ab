"""How memory is allocated and shared. The only module that knows.

- CPU: POSIX shared memory (a file under /dev/shm, mode 0600, unpredictable name),
  mapped as a flat uint8 tensor that another process can map by name.
- CUDA device memory: one cudaMalloc per pool through cupy, exportable with CUDA IPC
  (handle + offset from the allocation base).
- CUDA host memory: the shared-memory mapping is page-locked with cudaHostRegister.

Everything else sees `SharedBuffer.tensor`, a flat uint8 tensor.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch

from hicache.validate import is_int

ShmKind = Literal["shm", "cuda_ipc", "local"]
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
SHM_PREFIX = "hicache-"
K = TypeVar("K")
B = TypeVar("B")


def shm_dir() -> str:
    """Directory that backs POSIX shared memory (/dev/shm on Linux)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class MemoryHandle:
    """What another process needs to map a SharedBuffer."""

    kind: ShmKind
    nbytes: int
    name: str = ""  # shm segment name
    ipc_handle: bytes = b""  # cudaIpcMemHandle_t bytes
    offset: int = 0  # bytes from the allocation base


class SharedBuffer:
    """A flat uint8 tensor plus what it takes to share and release it."""

    def __init__(self, tensor: torch.Tensor, handle: MemoryHandle, release: Callable[[], None]):
        assert tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.numel() == handle.nbytes
        self.tensor = tensor
        self.handle = handle
        self._finalizer = weakref.finalize(self, release)

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Release the memory (unlink / unregister / close the IPC mapping). Idempotent."""
        self._finalizer()


def _check_nbytes(nbytes: int) -> None:
    if not is_int(nbytes) or nbytes < 1:
        raise ValueError(f"nbytes must be an int >= 1, got {nbytes!r}")


def create_shm(nbytes: int) -> SharedBuffer:
    """Create a new shared-memory segment, mode 0600 (whatever the umask), with an
    unpredictable name (96 random bits), unlinked on close, at exit, and on a SIGTERM the
    process does not handle itself (see _unlink_on_sigterm)."""
    _check_nbytes(nbytes)
    name = SHM_PREFIX + secrets.token_hex(12)
    path = os.path.join(shm_dir(), name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly owner read/write, whatever the umask
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    _LIVE_SEGMENTS.add(path)
    _unlink_on_sigterm()
    try:
        tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        tensor.zero_()  # fault every page in now, not on the first transfer
    except BaseException:
        _release_segment(path)
        raise
    return SharedBuffer(tensor, MemoryHandle("shm", nbytes, name=name), lambda: _release_segment(path))


# Segments this process created and has not unlinked yet. A set's add/discard/copy are atomic
# under the GIL, so the SIGTERM handler reads it without a lock (a lock could deadlock there).
_LIVE_SEGMENTS: set[str] = set()


def _release_segment(path: str) -> None:
    _LIVE_SEGMENTS.discard(path)
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
        for path in list(_LIVE_SEGMENTS):
            _unlink(path)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def open_shm(name: str, nbytes: int) -> SharedBuffer:
    """Map an existing segment created by create_shm in another process.

    Raises ValueError for a malformed name or a size mismatch, FileNotFoundError if absent.
    """
    _check_nbytes(nbytes)
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"invalid shared-memory name {name!r}")
    path = os.path.join(shm_dir(), name)
    try:  # O_NOFOLLOW: a symlink planted to map some other file fails here (ELOOP)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
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
        source = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path  # Linux: the open file
        tensor = torch.from_file(source, shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)  # the mapping stays
    return SharedBuffer(tensor, MemoryHandle("shm", nbytes, name=name), lambda: None)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_device_count() -> int:
    return torch.cuda.device_count() if cuda_available() else 0


def _cupy() -> Any:
    import cupy  # type: ignore[import-not-found]

    return cupy


def alloc_device(nbytes: int, device: str) -> SharedBuffer:
    """Allocate a device pool's memory: shared memory on "cpu", one exportable cudaMalloc on "cuda"."""
    if device == "cpu":
        return create_shm(nbytes)
    if not str(device).startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    _check_nbytes(nbytes)
    if not cuda_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    cp = _cupy()
    index = torch.device(device).index or 0
    with cp.cuda.Device(index):
        mem = cp.cuda.Memory(nbytes)  # a plain cudaMalloc: IPC-exportable, offset 0
        array = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(mem.ptr))
    tensor = torch.as_tensor(array, device=f"cuda:{index}")
    keep = [mem, array]
    return SharedBuffer(tensor, MemoryHandle("cuda_ipc", nbytes, ipc_handle=handle), keep.clear)


def open_cuda_ipc(handle: MemoryHandle, device: str = "cuda") -> SharedBuffer:
    """Open device memory exported by alloc_device in another process."""
    if handle.kind != "cuda_ipc":
        raise ValueError(f"expected a cuda_ipc handle, got kind {handle.kind!r}")
    cp = _cupy()
    index = torch.device(device).index or 0
    with cp.cuda.Device(index):
        base = cp.cuda.runtime.ipcOpenMemHandle(handle.ipc_handle)
        mem = cp.cuda.UnownedMemory(base, handle.offset + handle.nbytes, None)
        array = cp.ndarray((handle.nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, handle.offset))
    tensor = torch.as_tensor(array, device=f"cuda:{index}")
    return SharedBuffer(tensor, handle, lambda: cp.cuda.runtime.ipcCloseMemHandle(base))


class RefCountedOpens(Generic[K, B]):
    """Opens each key once and shares it between users; closes it when the last one releases.

    CUDA allows one cudaIpcOpenMemHandle per handle per process, so every mapping of one
    exported allocation (several pools, several offsets) must share that open. Thread-safe.
    """

    def __init__(self, open_fn: Callable[[K], B], close_fn: Callable[[B], None]):
        self._open_fn = open_fn
        self._close_fn = close_fn
        self._lock = threading.Lock()
        self._open: dict[K, tuple[B, int]] = {}

    def acquire(self, key: K) -> B:
        with self._lock:
            base, users = self._open[key] if key in self._open else (self._open_fn(key), 0)
            self._open[key] = (base, users + 1)
            return base

    def release(self, key: K) -> None:
        """Drop one user of `key`. Raises KeyError if it is not open."""
        with self._lock:
            if key not in self._open:
                raise KeyError(f"{key!r} is not open")
            base, users = self._open[key]
            if users > 1:
                self._open[key] = (base, users - 1)
                return
            del self._open[key]
            self._close_fn(base)  # under the lock: an acquire() meanwhile must not open it twice

    def users(self, key: K) -> int:
        with self._lock:
            return self._open[key][1] if key in self._open else 0

    def __len__(self) -> int:
        return len(self._open)


class CudaIpcOpens:
    """Opens CUDA IPC handles from other processes with refcounted opens (see RefCountedOpens)."""

    def __init__(self) -> None:
        self.bases: RefCountedOpens[tuple[bytes, int], int] = RefCountedOpens(self._open_base, self._close_base)

    @staticmethod
    def _open_base(key: tuple[bytes, int]) -> int:
        cp = _cupy()
        with cp.cuda.Device(key[1]):
            return int(cp.cuda.runtime.ipcOpenMemHandle(key[0]))

    @staticmethod
    def _close_base(base: int) -> None:
        _cupy().cuda.runtime.ipcCloseMemHandle(base)

    def open(self, handle: MemoryHandle, device: str = "cuda") -> SharedBuffer:
        """Map `handle` (nbytes at offset from its allocation base) on `device`."""
        if handle.kind != "cuda_ipc":
            raise ValueError(f"expected a cuda_ipc handle, got kind {handle.kind!r}")
        index = torch.device(device).index or 0
        key = (handle.ipc_handle, index)
        base = self.bases.acquire(key)
        try:
            cp = _cupy()
            with cp.cuda.Device(index):
                mem = cp.cuda.UnownedMemory(base, handle.offset + handle.nbytes, None)
                array = cp.ndarray((handle.nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, handle.offset))
            tensor = torch.as_tensor(array, device=f"cuda:{index}")
        except BaseException:
            self.bases.release(key)
            raise
        return SharedBuffer(tensor, handle, lambda: self.bases.release(key))


def pin_host(buffer: SharedBuffer) -> bool:
    """Page-lock a host buffer for fast DMA when CUDA is present. Returns whether it pinned."""
    if not cuda_available():
        return False
    try:
        cp = _cupy()
    except ImportError:
        return False
    ptr = buffer.tensor.data_ptr()
    cp.cuda.runtime.hostRegister(ptr, buffer.nbytes, 0)
    release = buffer._finalizer.detach()
    assert release is not None
    _, unlink, _, _ = release

    def _release() -> None:
        cp.cuda.runtime.hostUnregister(ptr)
        unlink()

    buffer._finalizer = weakref.finalize(buffer, _release)
    return True


def local_buffer(nbytes: int) -> SharedBuffer:
    """Private (unshared) memory, for tests and single-process use."""
    _check_nbytes(nbytes)
    return SharedBuffer(torch.zeros(nbytes, dtype=torch.uint8), MemoryHandle("local", nbytes), lambda: None)


def wrap_tensor(tensor: torch.Tensor) -> SharedBuffer:
    """View an existing flat uint8 tensor as an unshared buffer (the caller keeps ownership)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"expected a contiguous 1-D uint8 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    return SharedBuffer(tensor, MemoryHandle("local", tensor.numel()), lambda: None)
