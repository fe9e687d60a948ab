"""CUDA memory: device pools as one exportable cudaMalloc (CUDA IPC handle + offset), their
refcounted opens in another process, and page-locking host buffers (through cupy)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from hicache.memory.buffer import MemoryHandle, SharedBuffer, check_nbytes
from hicache.memory.shm import create_shm

log = logging.getLogger(__name__)
K = TypeVar("K")
B = TypeVar("B")


def _torch() -> Any:
    import torch  # here, not at import: a sidecar starts without torch

    return torch


def cuda_available() -> bool:
    return bool(_torch().cuda.is_available())


def cuda_device_count() -> int:
    return int(_torch().cuda.device_count()) if cuda_available() else 0


def cuda_index(device: str) -> int:
    """The index of CUDA device `device`: N for "cuda:N", and for "cuda" the current device
    (what torch means by it; asked only then, so naming a device initialises nothing)."""
    index = _torch().device(device).index
    return int(index) if index is not None else int(_torch().cuda.current_device())


def _cupy() -> Any:
    import cupy  # type: ignore[import-not-found]

    return cupy


def alloc_device(nbytes: int, device: str) -> SharedBuffer:
    """Allocate a device pool's memory: shared memory on "cpu", one exportable cudaMalloc on "cuda"."""
    if device == "cpu":
        return create_shm(nbytes)
    if not str(device).startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    check_nbytes(nbytes)
    if not cuda_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    cp = _cupy()
    index = cuda_index(device)
    with cp.cuda.Device(index):
        mem = cp.cuda.Memory(nbytes)  # a plain cudaMalloc: IPC-exportable, offset 0
        array = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(mem.ptr))
    tensor = _torch().as_tensor(array, device=f"cuda:{index}")
    keep = [mem, array]
    return SharedBuffer(tensor, MemoryHandle("cuda_ipc", nbytes, ipc_handle=handle), keep.clear)


def open_cuda_ipc(handle: MemoryHandle, device: str = "cuda") -> SharedBuffer:
    """Open device memory exported by alloc_device in another process."""
    if handle.kind != "cuda_ipc":
        raise ValueError(f"expected a cuda_ipc handle, got kind {handle.kind!r}")
    cp = _cupy()
    index = cuda_index(device)
    with cp.cuda.Device(index):
        base = cp.cuda.runtime.ipcOpenMemHandle(handle.ipc_handle)
        mem = cp.cuda.UnownedMemory(base, handle.offset + handle.nbytes, None)
        array = cp.ndarray((handle.nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, handle.offset))
    tensor = _torch().as_tensor(array, device=f"cuda:{index}")
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
        index = cuda_index(device)
        key = (handle.ipc_handle, index)
        base = self.bases.acquire(key)
        try:
            cp = _cupy()
            with cp.cuda.Device(index):
                mem = cp.cuda.UnownedMemory(base, handle.offset + handle.nbytes, None)
                array = cp.ndarray((handle.nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, handle.offset))
            tensor = _torch().as_tensor(array, device=f"cuda:{index}")
        except BaseException:
            self.bases.release(key)
            raise
        return SharedBuffer(tensor, handle, lambda: self.bases.release(key))


_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly (CUDA 11.1)


def pin_host(buffer: SharedBuffer, *, read_only: bool = False) -> bool:
    """Page-lock a host buffer for fast DMA when CUDA is present (`read_only`: a mapping the
    GPU only reads, cudaHostRegisterReadOnly). Returns whether it pinned: where CUDA refuses
    (the memlock limit, too little memory to lock), the buffer stays pageable, which copies
    slower but the same bytes, and a warning says so."""
    if not cuda_available():
        return False
    try:
        cp = _cupy()
    except ImportError:
        return False
    ptr = buffer.tensor.data_ptr()
    try:
        cp.cuda.runtime.hostRegister(ptr, buffer.nbytes, _HOST_REGISTER_READ_ONLY if read_only else 0)
    except Exception as exc:  # cupy's CUDARuntimeError; any refusal leaves the buffer as it was
        log.warning("host pool of %d bytes not pinned (%s): its copies run from pageable memory", buffer.nbytes, exc)
        return False
    release = buffer._finalizer.detach()
    assert release is not None
    _, unlink, _, _ = release

    def _release() -> None:
        cp.cuda.runtime.hostUnregister(ptr)
        unlink()

    buffer._finalizer = weakref.finalize(buffer, _release)
    return True
