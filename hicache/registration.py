"""RegisterPool's checks and device mapping: the geometry handshake and the engine's memory."""

from __future__ import annotations

from hicache.geometry import KVGeometry
from hicache.memory import CudaIpcOpens, MemoryHandle, cuda_available, cuda_device_count
from hicache.pools import DeviceKVPool


def check_geometry(expected: dict[str, KVGeometry] | None, group: str, geometry: KVGeometry) -> None:
    """Raises ValueError for a group the model lacks or, naming each differing field with both
    values, a geometry other than the expected one. expected None accepts any geometry."""
    if expected is None:
        return
    if group not in expected:
        raise ValueError(f"group {group!r} is not in the sidecar's model; it has {sorted(expected)}")
    want = expected[group]
    fields = want.diff(geometry)
    if fields:
        mine, theirs = want.to_dict(), geometry.to_dict()
        detail = ", ".join(f"{f} (engine {theirs[f]!r}, sidecar {mine[f]!r})" for f in fields)
        raise ValueError(f"geometry of group {group!r} differs from the sidecar's model config: {detail}")


def map_device(
    geometry: KVGeometry, pages: int, memory: MemoryHandle, cuda_device: int, ipc: CudaIpcOpens
) -> DeviceKVPool:
    """Map the engine's device pool: shared memory by name, or a refcounted CUDA IPC open.
    Raises ValueError for a missing segment, a size mismatch or an unknown kind."""
    if memory.kind == "shm":
        try:
            return DeviceKVPool.attach(geometry, pages, memory)
        except FileNotFoundError:
            raise ValueError(f"device memory shm {memory.name!r} does not exist") from None
    if memory.kind == "cuda_ipc":
        check_cuda_ipc(memory, cuda_device)
        device = f"cuda:{cuda_device}"
        return DeviceKVPool(geometry, pages, device, memory=ipc.open(memory, device))
    raise ValueError(f"device memory kind must be 'shm' or 'cuda_ipc', got {memory.kind!r}")


CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def check_cuda_ipc(memory: MemoryHandle, cuda_device: int) -> None:
    """Raises ValueError, before anything is opened, for CUDA IPC memory this sidecar cannot
    map: no CUDA here, a handle that is not a cudaIpcMemHandle_t, or no such device."""
    if not cuda_available():
        raise ValueError("device memory kind 'cuda_ipc' needs CUDA on the sidecar, and it has none")
    if len(memory.ipc_handle) != CUDA_IPC_HANDLE_BYTES:
        raise ValueError(f"cuda_ipc handle must be {CUDA_IPC_HANDLE_BYTES} bytes, got {len(memory.ipc_handle)}")
    count = cuda_device_count()
    if isinstance(cuda_device, bool) or not isinstance(cuda_device, int) or not 0 <= cuda_device < count:
        raise ValueError(f"cuda_device {cuda_device!r} out of range: the sidecar sees {count} CUDA devices")
