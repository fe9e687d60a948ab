"""Mappings given back without waiting for the garbage collector.

A tensor made by torch.from_file (or over an mmap) keeps its file mapped until the tensor
itself is freed, and a reference cycle anywhere that holds it (an exception's traceback, a
closure) defers that to the cycle collector: the file's memory stays in /dev/shm although it
was unlinked. So closing a buffer here does not wait for the tensor. The creator of a
segment punches out its whole memory (it reads as zeros in every process that still maps
it), and every process replaces its own mapping, in place, with private anonymous memory
that costs nothing until touched: a late access by a stale tensor reads zeros instead of
faulting, and the tensor's own munmap, whenever it runs, unmaps that.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
MAP_FAILED = ctypes.c_void_p(-1).value
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
PROT_NONE = 0
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def libc_mmap(addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    """libc's mmap; raises OSError where it fails (or maps elsewhere than a fixed `addr`)."""
    got = _libc.mmap(addr, length, prot, flags, fd, offset)
    if got in (None, MAP_FAILED) or (flags & MAP_FIXED and got != addr):
        raise OSError(ctypes.get_errno(), f"mmap of {length} bytes failed")
    return int(got)


def munmap(addr: int, length: int) -> None:
    _libc.munmap(addr, length)


def map_read_only(fd: int, nbytes: int) -> torch.Tensor:
    """A PROT_READ, MAP_SHARED mapping of `fd` as a flat uint8 tensor that does not own it
    (drop_mapping releases it; a write through it faults). Raises OSError."""
    import torch

    base = libc_mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(base), dtype=torch.uint8)


def drop_mapping(addr: int, length: int) -> None:
    """Replace the mapping at [addr, addr + length) with private anonymous memory, at once:
    the file that was mapped there is no longer held by this process. Never raises (a
    mapping that cannot be replaced stays until its owner unmaps it)."""
    if length <= 0:
        return
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE
    try:
        libc_mmap(addr, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    except OSError:
        pass


def punch_holes(fd: int, spans: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> bool:
    """Give the memory of the (offset, length) ranges of the file `fd` back to the system (they
    read as zeros after, in every mapping). False where the file system cannot."""
    return all(_libc.fallocate(fd, _PUNCH_HOLE, offset, length) == 0 for offset, length in spans)


def punch_path(path: str, nbytes: int) -> bool:
    """punch_holes over the whole file at `path`; False where it cannot be opened or punched."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return punch_holes(fd, [(0, nbytes)])
    finally:
        os.close(fd)
