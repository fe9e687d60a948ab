"""SharedBuffer: a flat uint8 tensor with the handle another process maps it by, and its release."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from hicache.validate import is_int

ShmKind = Literal["shm", "cuda_ipc", "local", "fd"]


@dataclass(frozen=True)
class MemoryHandle:
    """What another process needs to map a SharedBuffer."""

    kind: ShmKind
    nbytes: int
    name: str = ""  # shm segment name; for "fd", the comma-separated ids of the sent fds
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


def check_nbytes(nbytes: int) -> None:
    if not is_int(nbytes) or nbytes < 1:
        raise ValueError(f"nbytes must be an int >= 1, got {nbytes!r}")


def local_buffer(nbytes: int) -> SharedBuffer:
    """Private (unshared) memory, for tests and single-process use."""
    check_nbytes(nbytes)
    return SharedBuffer(torch.zeros(nbytes, dtype=torch.uint8), MemoryHandle("local", nbytes), lambda: None)


def wrap_tensor(tensor: torch.Tensor) -> SharedBuffer:
    """View an existing flat uint8 tensor as an unshared buffer (the caller keeps ownership)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"expected a contiguous 1-D uint8 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    return SharedBuffer(tensor, MemoryHandle("local", tensor.numel()), lambda: None)
