"""SGLang's flat pages: what it stores and loads without interface_v1 (get_data_page(flat=True),
get_dummy_flat_data_page). A flat page is one page in its host pool's own layout, each buffer's
rows back to back, so it is one page of the same EngineLayout ("sglang_<layout>") as the pool.
Flat pages are copied through scratch pages of that layout in this process, with the engine
copy path's grants on the link's sidecar pool (a page is published only once it is copied)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from hicache.api import KeyStatus
from hicache.client import HiCacheClient, RegisteredPool
from hicache.client.engine_copy import EngineCopy, local_pool
from hicache.geometry import KVGeometry
from hicache.memory import local_buffer, wrap_tensor
from hicache.pools import DeviceKVPool

LOADED = (KeyStatus.LOADED, KeyStatus.LOADED_FROM_STORAGE)
KEPT = (KeyStatus.STORED, KeyStatus.DEDUPLICATED)


def loaded_prefix(statuses: Sequence[KeyStatus]) -> int:
    """How many keys from the first were loaded (a get stops at the first miss)."""
    return next((i for i, s in enumerate(statuses) if s not in LOADED), len(statuses))


class FlatPages:
    """Flat pages to and from sidecar pool `info`, through `size` scratch pages in `layout`.
    Thread-safe: one lock (SGLang calls from its prefetch and backup threads at once).
    Raises ValueError or OSError where the sidecar's host pool cannot be mapped here."""

    def __init__(self, client: HiCacheClient, info: RegisteredPool, geometry: KVGeometry, layout: str, size: int):
        self.geometry, self.layout, self.size = geometry, layout, size
        self.scratch = local_pool(geometry, size, local_buffer(geometry.pool_bytes(size)), layout)
        pid = info.pool_id
        self.copier = EngineCopy.attach(
            self.scratch,
            info.host_shm_name,
            info.host_pages,
            info.host_layout,
            info.window_shm_name,
            info.window_pages,
            lambda keys, offload: client.begin_copy(keys, offload=offload, pool=pid),
            lambda grant, commit, seconds: client.end_copy(grant, commit=commit, copy_seconds=seconds, pool=pid),
        )
        self._lock = threading.Lock()

    def page(self, flat: Any) -> DeviceKVPool:
        """`flat` (one flat page: a contiguous CPU tensor of page_bytes) as a one-page pool.
        Raises ValueError naming what it is instead."""
        g = self.geometry
        if not isinstance(flat, torch.Tensor) or flat.device.type != "cpu" or not flat.is_contiguous():
            what = f"{flat.device} {tuple(flat.shape)}" if isinstance(flat, torch.Tensor) else type(flat).__name__
            raise ValueError(f"a flat page must be a contiguous CPU tensor, got {what}")
        nbytes = flat.numel() * flat.element_size()
        if nbytes != g.page_bytes:
            raise ValueError(f"a flat page of this pool holds {g.page_bytes} bytes, got {nbytes} ({flat.dtype})")
        return local_pool(g, 1, wrap_tensor(flat.reshape(-1).view(torch.uint8)), self.layout)

    def set(self, keys: Sequence[bytes], flats: Sequence[Any]) -> list[bool]:
        """Store flat pages under keys; True where the sidecar holds the page now."""
        pages = [self.page(f) for f in flats]
        if len(pages) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(pages)} flat pages")
        out: list[bool] = []
        with self._lock:
            for start in range(0, len(keys), self.size):
                chunk = pages[start : start + self.size]
                for i, p in enumerate(chunk):
                    self.scratch.copy_pages_from(p, [0], [i])
                res = self.copier.offload(keys[start : start + self.size], range(len(chunk)))
                out += [s in KEPT for s in res.statuses]
        return out

    def get(self, keys: Sequence[bytes], flats: Sequence[Any]) -> list[bool]:
        """Load keys into flat pages; True for the loaded prefix (flat pages past it untouched)."""
        pages = [self.page(f) for f in flats]
        if len(pages) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(pages)} flat pages")
        out = [False] * len(keys)
        with self._lock:
            for start in range(0, len(keys), self.size):
                chunk = pages[start : start + self.size]
                n = loaded_prefix(self.copier.reload(keys[start : start + self.size], range(len(chunk))).statuses)
                for i in range(n):
                    chunk[i].copy_pages_from(self.scratch, [i], [0])
                out[start : start + n] = [True] * n
                if n < len(chunk):
                    break
        return out

    def close(self) -> None:
        """Unmap the sidecar's host pool here and free the scratch pages."""
        self.copier.close()
        self.scratch.close()
