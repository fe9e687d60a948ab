"""The sidecar's host mirror pool."""

from __future__ import annotations

from hicache.geometry import KVGeometry
from hicache.memory import MemoryHandle, SharedBuffer, create_shm, open_shm, pin_host
from hicache.pools.flat import FlatPool
from hicache.pools.layouts import make_layout


class HostKVPool(FlatPool):
    """Host memory mirroring device pages: num_pages * geometry.page_bytes bytes exactly.

    Allocated as POSIX shared memory (so an engine can map it too) and page-locked with
    cudaHostRegister when CUDA is present. `layout` is "layer_first", "page_first" or
    "page_first_direct" (see hicache.pools.layouts). Any page of any layout reads and
    writes as one flat canonical block with read_page/write_page.

    Raises ValueError for num_pages < 1 or an unknown layout.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        layout: str = "layer_first",
        *,
        memory: SharedBuffer | None = None,
    ):
        lay = make_layout(layout, geometry, num_pages)
        super().__init__(geometry, lay, memory if memory is not None else create_shm(lay.nbytes))
        self.pinned = memory is None and pin_host(self.memory)

    @classmethod
    def attach(cls, geometry: KVGeometry, num_pages: int, layout: str, handle: MemoryHandle) -> HostKVPool:
        """Map a host pool that another process created, from its shared-memory `handle`."""
        if handle.kind != "shm":
            raise ValueError(f"a host pool is shared through shm, got kind {handle.kind!r}")
        return cls(geometry, num_pages, layout, memory=open_shm(handle.name, geometry.pool_bytes(num_pages)))

    @property
    def layout_name(self) -> str:
        return self.layout.name
