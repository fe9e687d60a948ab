"""How memory is allocated and shared. The only package that knows.

- CPU: POSIX shared memory (a file under /dev/shm, mode 0600, unpredictable name),
  mapped as a flat uint8 tensor that another process can map by name.
- CUDA device memory: one cudaMalloc per pool through cupy, exportable with CUDA IPC
  (handle + offset from the allocation base).
- CUDA host memory: the shared-memory mapping is page-locked with cudaHostRegister.
- Engine memory without a name (memfd): sent as fds over a Unix socket (fd.py).
- An engine's separate allocations seen as one buffer in its own process (span_buffer), for
  the copies it makes itself.

Everything else sees `SharedBuffer.tensor`, a flat uint8 tensor.
"""

from hicache.memory.buffer import (
    MemoryHandle,
    SharedBuffer,
    ShmKind,
    SpanBuffer,
    local_buffer,
    span_buffer,
    wrap_tensor,
)
from hicache.memory.cuda import (
    CudaIpcOpens,
    RefCountedOpens,
    alloc_device,
    cuda_available,
    cuda_device_count,
    cuda_index,
    open_cuda_ipc,
    pin_host,
)
from hicache.memory.fd import FdStore, fd_socket_path, map_fds, segment_offsets, send_fds, serve_fds
from hicache.memory.maps import MappedFile, shared_file_of
from hicache.memory.shm import (
    SHM_PREFIX,
    commit_shm,
    create_shm,
    open_shm,
    owns_shm,
    release_shm,
    shm_dir,
    sweep_dead_segments,
)

__all__ = [
    "SHM_PREFIX",
    "CudaIpcOpens",
    "FdStore",
    "MappedFile",
    "MemoryHandle",
    "RefCountedOpens",
    "SharedBuffer",
    "ShmKind",
    "SpanBuffer",
    "alloc_device",
    "commit_shm",
    "create_shm",
    "release_shm",
    "cuda_available",
    "cuda_device_count",
    "cuda_index",
    "fd_socket_path",
    "local_buffer",
    "map_fds",
    "open_cuda_ipc",
    "open_shm",
    "owns_shm",
    "pin_host",
    "segment_offsets",
    "send_fds",
    "serve_fds",
    "shared_file_of",
    "shm_dir",
    "span_buffer",
    "sweep_dead_segments",
    "wrap_tensor",
]
