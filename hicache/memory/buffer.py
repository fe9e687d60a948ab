"""SharedBuffer: a flat uint8 tensor with the handle another process maps it by, and its release."""

from __future__ import annotations

import ctypes
import fcntl
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from hicache.validate import is_int

if TYPE_CHECKING:
    import torch  # imported where a buffer is made: a sidecar starts without torch

try:  # fstat keeping the GIL; os.fstat lets go of it (built by setup.py where a C compiler exists)
    from hicache.memory import _fdsize

    fd_size = _fdsize.fd_size
    FD_SIZE_KEEPS_GIL = True
except ImportError:
    FD_SIZE_KEEPS_GIL = False

    def fd_size(fd: int, /) -> int:
        return os.fstat(fd).st_size


ShmKind = Literal["shm", "cuda_ipc", "local", "fd", "engine"]  # engine: not shared, the engine copies


@dataclass(frozen=True)
class MemoryHandle:
    """What another process needs to map a SharedBuffer."""

    kind: ShmKind
    nbytes: int
    name: str = ""  # shm segment name; for "fd", the comma-separated ids of the sent fds
    ipc_handle: bytes = b""  # cudaIpcMemHandle_t bytes
    offset: int = 0  # bytes from the allocation base
    # kind "shm": the secret that shows the holder made the segment (see memory.shm.owns_shm);
    # "" in handles of segments opened by name. Never logged.
    proof: str = field(default="", repr=False)


class SharedBuffer:
    """A flat uint8 tensor plus what it takes to share and release it."""

    def __init__(
        self,
        tensor: torch.Tensor,
        handle: MemoryHandle,
        release: Callable[[], None],
        damage: Callable[[], str | None] | None = None,
    ):
        assert str(tensor.dtype) == "torch.uint8" and tensor.dim() == 1 and tensor.numel() == handle.nbytes
        self.tensor = tensor
        self.handle = handle
        self._damage = damage
        self._finalizer = weakref.finalize(self, release)

    def damage(self) -> str | None:
        """What another process changed under this mapping (a file shrunk below the mapped
        size, whose pages would fault with SIGBUS), or None. Memory this process owns, and
        mappings that cannot shrink, have nothing to report."""
        return None if self._damage is None else self._damage()

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
    import torch

    check_nbytes(nbytes)
    return SharedBuffer(torch.zeros(nbytes, dtype=torch.uint8), MemoryHandle("local", nbytes), lambda: None)


def wrap_tensor(tensor: torch.Tensor) -> SharedBuffer:
    """View an existing flat uint8 tensor as an unshared buffer (the caller keeps ownership)."""
    import torch

    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"expected a contiguous 1-D uint8 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    return SharedBuffer(tensor, MemoryHandle("local", tensor.numel()), lambda: None)


class SpanBuffer(SharedBuffer):
    """Several allocations of this process seen as one flat buffer: the address range from
    the lowest segment's start to the highest one's end. `segments`: each segment's (offset,
    nbytes) in it, in the order given. Only the segments' bytes are this buffer's: what lies
    between them is not, and nothing may touch it (a layout whose regions each lie within one
    segment, see hicache.pools.layouts.check_segments, keeps copies there)."""

    def __init__(self, tensor: torch.Tensor, segments: tuple[tuple[int, int], ...], owners: Sequence[object]):
        held = list(owners)  # the segments' tensors, alive until close()
        super().__init__(tensor, MemoryHandle("local", tensor.numel()), held.clear)
        self.segments = segments


def span_buffer(segments: Sequence[torch.Tensor]) -> SpanBuffer:
    """One flat buffer over `segments`, contiguous CPU tensors of this process (an engine's
    separate K and V allocations); they stay theirs, and alive while the buffer is open.
    Raises ValueError for no segment, one on another device or not contiguous, or two that
    overlap."""
    import torch

    if not segments:
        raise ValueError("a span needs at least one segment, got none")
    for i, t in enumerate(segments):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            what = f"{t.device} {t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"segment {i} must be a non-empty contiguous CPU tensor, got {what}")
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in segments]
    ordered = sorted(range(len(spans)), key=lambda i: spans[i][0])
    for a, b in zip(ordered, ordered[1:], strict=False):
        if spans[a][0] + spans[a][1] > spans[b][0]:
            raise ValueError(
                f"segments {a} and {b} overlap: {a} holds {spans[a][1]} bytes from {spans[a][0]:#x}, "
                f"{b} starts at {spans[b][0]:#x}"
            )
    lo = spans[ordered[0]][0]
    hi = max(start + n for start, n in spans)
    tensor = torch.frombuffer((ctypes.c_uint8 * (hi - lo)).from_address(lo), dtype=torch.uint8)
    return SpanBuffer(tensor, tuple((start - lo, n) for start, n in spans), tuple(segments))


def shrunk(fds: list[int], sizes: list[int], what: str) -> Callable[[], str | None]:
    """A damage check for files mapped from `fds` (kept open by the caller): the first one
    now smaller than the size that was mapped. It runs before every copy, so it keeps the GIL
    (fd_size): a check that let go of it would wait to take it back beside a busy thread."""

    def check() -> str | None:
        for fd, size in zip(fds, sizes, strict=True):
            now = fd_size(fd)
            if now < size:
                return f"{what} shrank from {size} to {now} bytes under the sidecar"
        return None

    return check


def seal_shrink(fd: int) -> bool:
    """Forbid shrinking a memfd (F_SEAL_SHRINK), so that its mapping can never fault; False
    for a file that cannot be sealed (no MFD_ALLOW_SEALING, a /dev/shm file)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return True
    except (OSError, AttributeError):
        return False
