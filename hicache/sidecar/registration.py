"""RegisterPool's checks and device mapping: the geometry handshake and the engine's memory."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from hicache.geometry import KVGeometry
from hicache.keys import KEY_BYTES
from hicache.memory import (
    CudaIpcOpens,
    FdStore,
    MemoryHandle,
    cuda_available,
    cuda_device_count,
    map_fds,
    open_shm,
    owns_shm,
)
from hicache.memory.cuda_events import check_event_handles
from hicache.pools.layouts import BlockLayout, check_engine_layout, check_segments, engine_layout
from hicache.validate import is_int

MAX_OFFLOAD_EVENTS = 256  # interprocess events one engine may hand a pool for its offloads

if TYPE_CHECKING:
    from hicache.pools import DeviceKVPool
    from hicache.pools.mapped import MappedKVPool


@dataclass(frozen=True)
class PoolIdentity:
    """Who a registered pool belongs to and how its keys are hashed."""

    pool_id: str
    group: str
    namespace: str
    model_id: str
    key_hash: str
    key_bytes: int
    secret: str = field(default="", repr=False)  # what a caller must present to use the pool
    rank: str = "tp0of1"  # the engine rank's slice (tensor parallelism), for stable metric labels

    @property
    def series(self) -> str:
        """A name for the pool that survives re-registration (its id does not): model,
        namespace, group and rank. Metrics label per-pool series with it."""
        return f"{self.model_id or 'unnamed'}|{self.namespace}|{self.group}|{self.rank}"


@dataclass(frozen=True)
class PoolRequest:
    """What an engine registers: one KV group's device pool and how its pages are keyed."""

    geometry: KVGeometry
    device_pages: int
    device_memory: MemoryHandle
    group: str = "full"
    namespace: str = ""
    model_id: str = ""
    key_hash: str = "sha256"
    cuda_device: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    device_layout: str = ""  # "" (hicache's layer_first), an EngineLayout or a BlockLayout name
    offload_events: tuple[bytes, ...] = ()  # the engine's interprocess CUDA events (CUDA pools)

    def check(self, expected: dict[str, KVGeometry] | None, storage_backend: str) -> None:
        """Raises ValueError naming the first bad value; nothing is mapped or allocated yet."""
        check_owned(self.device_memory)
        check_geometry(expected, self.group, self.geometry)
        if not is_int(self.device_pages) or self.device_pages < 1:
            raise ValueError(f"device_pages must be an int >= 1, got {self.device_pages!r}")
        if self.key_hash not in KEY_BYTES:
            raise ValueError(f"unknown key hash {self.key_hash!r}; expected one of {list(KEY_BYTES)}")
        for name, value in (("namespace", self.namespace), ("model_id", self.model_id)):
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a str, got {type(value).__name__}")
        if not self.model_id and storage_backend != "none":
            raise ValueError(
                "model_id must name the model and its revision when a storage tier is configured "
                f"(backend {storage_backend!r}), got ''"
            )
        tp_size, tp_rank = self.tp_size, self.tp_rank
        if not is_int(tp_size) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
        if not is_int(tp_rank) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be an int in [0, tp_size={tp_size}), got {tp_rank!r}")
        if self.offload_events:
            if self.device_memory.kind != "cuda_ipc":
                raise ValueError(
                    "offload_event_handles are CUDA events, for CUDA pools; "
                    f"device memory of kind {self.device_memory.kind!r} needs none"
                )
            check_event_handles("offload_event_handles", self.offload_events, MAX_OFFLOAD_EVENTS)
        if self.device_memory.kind == "engine":
            if self.device_layout:
                raise ValueError(
                    f"device memory of kind 'engine' takes no device_layout (the engine addresses its own memory), "
                    f"got {self.device_layout!r}"
                )
            return
        if self.device_layout:
            check_engine_layout(self.device_layout)
            kinds = ("fd", "shm", "cuda_ipc") if self.device_layout.startswith(BlockLayout.PREFIX) else ("fd", "shm")
            if self.device_memory.kind not in kinds:
                raise ValueError(
                    f"device layout {self.device_layout!r} needs memory of kind {' or '.join(kinds)}, "
                    f"got {self.device_memory.kind!r}"
                )
            self._check_layout_fits()
            return
        if self.device_memory.kind == "fd":
            raise ValueError("device memory of kind 'fd' needs a device_layout")
        need = self.geometry.pool_bytes(self.device_pages)
        if self.device_memory.nbytes != need:
            raise ValueError(
                f"device memory holds {self.device_memory.nbytes} bytes but {self.device_pages} pages "
                f"of this geometry need {need}"
            )

    def _check_layout_fits(self) -> None:
        """Raises ValueError when device_pages pages of the engine's layout need more bytes than
        its memory holds, by arithmetic alone: the host pool is sized from device_pages before
        the memory is mapped (where fd segments' own offsets are checked again)."""
        nbytes = self.device_memory.nbytes
        if not is_int(nbytes) or nbytes < 1:
            raise ValueError(f"device memory nbytes must be an int >= 1, got {nbytes!r}")
        try:
            engine_layout(self.geometry, self.device_pages, self.device_layout, None, nbytes)
        except ValueError as exc:
            raise ValueError(f"{exc} (device_pages={self.device_pages})") from None

    @property
    def stored_model_id(self) -> str:
        """The model identity stored pages carry. With tensor parallelism each rank caches other
        KV heads under the same page keys, so the rank is part of it."""
        model = self.model_id or "unnamed"
        return model if self.tp_size == 1 else f"{model}|tp{self.tp_rank}of{self.tp_size}"


def check_owned(memory: MemoryHandle) -> None:
    """Raises ValueError for a shared-memory segment the caller has not shown it made (its
    proof, see hicache.memory.shm.owns_shm): anyone who may call the sidecar could otherwise
    have it read and write any file in /dev/shm its uid can open, another pool's segments
    included. The answer is the same whether or not the segment exists (no file is read).
    fds sent over the Unix socket and CUDA IPC handles are held only by their owner."""
    if memory.kind == "shm" and not owns_shm(memory.name, memory.proof):
        raise ValueError(
            f"device memory shm {memory.name!r} is refused: the sidecar maps only memory the engine shows "
            "it owns (a segment hicache's client made, sent with its proof, or fds sent over the Unix socket)"
        )


def check_geometry(expected: dict[str, KVGeometry] | None, group: str, geometry: KVGeometry) -> None:
    """Raises ValueError for a group the model lacks or, naming each differing field with both
    values, a geometry other than the expected one. A pipeline stage's pool, holding some of
    the group's layers (its layer_ids among the group's), is checked against the group cut to
    those layers. expected None accepts any geometry."""
    if expected is None:
        return
    if group not in expected:
        raise ValueError(f"group {group!r} is not in the sidecar's model; it has {sorted(expected)}")
    want = expected[group]
    ids = geometry.layer_ids
    if ids is not None and want.layer_ids is not None and ids != want.layer_ids and set(ids) <= set(want.layer_ids):
        want = replace(want, layer_num=len(ids), layer_ids=ids)  # a stage: its own layers
    fields = want.diff(geometry)
    if fields:
        mine, theirs = want.to_dict(), geometry.to_dict()
        detail = ", ".join(f"{f} (engine {theirs[f]!r}, sidecar {mine[f]!r})" for f in fields)
        raise ValueError(f"geometry of group {group!r} differs from the sidecar's model config: {detail}")


def map_engine_layout(
    geometry: KVGeometry,
    pages: int,
    memory: MemoryHandle,
    layout: str,
    fds: FdStore,
    ipc: CudaIpcOpens | None = None,
    cuda_device: int = 0,
) -> MappedKVPool:
    """Map an engine's memory in its own layout: fds it sent (one segment, or one per buffer:
    SGLang's K and V memfds), shared memory by name, or (a BlockLayout: vLLM's allocation)
    CUDA memory by IPC. Raises ValueError for unknown fd ids, a missing segment, or memory
    too small for the layout (an fd's own size, not only its page-rounded place, bounds the
    buffer it holds); nothing stays mapped or open then."""
    from hicache.pools.mapped import MappedKVPool  # torch: loaded with the first pool

    bases: tuple[int, ...] | None = None
    segments: list[tuple[str, int, int]] = []  # fd segments: (name, offset, size)
    if memory.kind == "cuda_ipc":
        if ipc is None:
            raise ValueError("CUDA IPC memory needs the sidecar's CUDA opens")
        check_cuda_ipc(memory, cuda_device)
        buf = ipc.open(memory, f"cuda:{cuda_device}")
    elif memory.kind == "fd":
        ids = memory.name.split(",")
        buf, offsets, sizes = map_fds(fds.take(ids), memory)
        segments = [
            (f"fd segment {i} ({fid})", offset, size)
            for i, (fid, offset, size) in enumerate(zip(ids, offsets, sizes, strict=True))
        ]
        if len(offsets) not in (1, len(geometry.buffers)):
            buf.close()
            raise ValueError(
                f"{len(offsets)} fd segments for {len(geometry.buffers)} buffers: send one, or one per buffer"
            )
        bases = tuple(offsets) if len(offsets) > 1 else None
    else:
        try:
            buf, bases = open_shm(memory.name, memory.nbytes), None
        except FileNotFoundError:
            raise ValueError(f"device memory shm {memory.name!r} does not exist") from None
    try:
        pool_layout = engine_layout(geometry, pages, layout, bases, buf.nbytes)
        if segments:
            check_segments(pool_layout, segments)
        return MappedKVPool(geometry, pool_layout, buf)
    except BaseException:
        buf.close()
        raise


def map_device(
    geometry: KVGeometry, pages: int, memory: MemoryHandle, cuda_device: int, ipc: CudaIpcOpens
) -> DeviceKVPool:
    """Map the engine's device pool: shared memory by name, or a refcounted CUDA IPC open.
    Raises ValueError for a missing segment, a size mismatch or an unknown kind."""
    from hicache.pools import DeviceKVPool  # torch: loaded with the first pool

    if memory.kind == "shm":
        try:
            return DeviceKVPool.attach(geometry, pages, memory)
        except FileNotFoundError:
            raise ValueError(f"device memory shm {memory.name!r} does not exist") from None
    if memory.kind == "cuda_ipc":
        check_cuda_ipc(memory, cuda_device)
        device = f"cuda:{cuda_device}"
        opened = ipc.open(memory, device)
        try:
            return DeviceKVPool(geometry, pages, device, memory=opened)
        except BaseException:
            opened.close()  # drops this open's reference
            raise
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
    if not is_int(cuda_device) or not 0 <= cuda_device < count:
        raise ValueError(f"cuda_device {cuda_device!r} out of range: the sidecar sees {count} CUDA devices")
