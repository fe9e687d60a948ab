"""The sidecar's host mirror pool."""

from __future__ import annotations

from collections.abc import Sequence

from hicache.geometry import KVGeometry
from hicache.memory import (
    MemoryHandle,
    SharedBuffer,
    commit_shm,
    create_shm,
    cuda_available,
    open_shm,
    pin_host,
    release_shm,
)
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
        committed_pages: int | None = None,
    ):
        """committed_pages: allocate only pages [0, committed_pages) now (the rest as the pool
        grows: commit_pages and release_pages move the line). Pinned memory (CUDA) is locked
        whole, so there all pages are committed; self.committed_pages says how many are."""
        lay = make_layout(layout, geometry, num_pages)
        if memory is None:
            # pinned memory (CUDA) is locked whole: there a budget moves the usable line only
            sparse = committed_pages is not None and not cuda_available()
            spans = lay.page_spans(range(committed_pages)) if sparse and committed_pages is not None else None
            memory = create_shm(lay.nbytes, spans)
            self.pinned = pin_host(memory)
            self.committed_pages = committed_pages if sparse and committed_pages is not None else num_pages
        else:
            self.pinned = False
            self.committed_pages = num_pages  # another process's memory: as it made it
        super().__init__(geometry, lay, memory)

    @classmethod
    def attach(
        cls, geometry: KVGeometry, num_pages: int, layout: str, handle: MemoryHandle, *, read_only: bool = False
    ) -> HostKVPool:
        """Map a host pool that another process created, from its shared-memory `handle`;
        `read_only`: for reading only (a write through it faults)."""
        if handle.kind != "shm":
            raise ValueError(f"a host pool is shared through shm, got kind {handle.kind!r}")
        memory = open_shm(handle.name, geometry.pool_bytes(num_pages), read_only=read_only)
        return cls(geometry, num_pages, layout, memory=memory)

    @property
    def layout_name(self) -> str:
        return self.layout.name

    def commit_pages(self, first: int, end: int) -> None:
        """Allocate the memory of pages [first, end). Raises OSError ENOSPC if it does not fit."""
        commit_shm(self.handle.name, self.layout.page_spans(range(first, end)))

    def release_pages(self, pages: Sequence[int]) -> bool:
        """Give the memory of `pages` (which must hold nothing) back; they read as zeros after.
        False where it cannot be (pinned for CUDA, or a file system without hole punching)."""
        if not pages or self.pinned:
            return False
        return release_shm(self.handle.name, self.layout.page_spans(pages))
