"""One SGLang host pool linked to one sidecar pool: its geometry, its registration (redone
after a sidecar restart), and the page moves of a batch.

Each set or get is one copy between SGLang's host pages and the sidecar's host pool, in
SGLang's own layout ("sglang_<layout>", hicache.pools.layouts.EngineLayout); Offload/Reload
name SGLang's host page numbers. Who copies (the pool's copy_path in the sidecar's stats):
- "sidecar" (extra config copy "direct"): SGLang's host pool lives in memfds ("allocator":
  "shm"); their fds go to the sidecar, which maps the pool and copies itself.
- "engine" (copy "engine", or its former name "staging"): otherwise. This process maps the
  sidecar's host pool and copies between it and SGLang's host buffers (K and V: one
  allocation, or two when their head dims differ, seen as one memory.SpanBuffer); the
  sidecar grants host pages and publishes them only once the copy is committed.
  ("staging" once meant a staging pool in between: two copies each way.)
Flat pages (SGLang without interface_v1) go through flat_pages.FlatPages on either path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from hicache.client import HiCacheClient, HiCacheRpcError, RegisteredPool
from hicache.geometry import KVGeometry
from hicache.integrations.sglang.flat_pages import KEPT, FlatPages, loaded_prefix
from hicache.integrations.sglang.pool_views import host_segments
from hicache.memory import MemoryHandle, SpanBuffer, segment_offsets, span_buffer

log = logging.getLogger("hicache.integrations.sglang")


def page_numbers(host_indices: torch.Tensor, page_size: int, n_keys: int) -> list[int]:
    """SGLang's token slots (n_keys * page_size, page-aligned runs) as host page numbers.
    Raises ValueError when they do not cover n_keys whole pages."""
    slots = host_indices.reshape(-1)
    if slots.numel() != n_keys * page_size:
        raise ValueError(f"{n_keys} keys need {n_keys * page_size} host slots, got {slots.numel()}")
    starts = slots[::page_size].to(torch.long)
    if bool((starts % page_size).any()):
        raise ValueError("host_indices do not start each page on a page boundary")
    return (starts // page_size).tolist()


class PoolLink:
    """Thread-safe. direct: the sidecar copies (SGLang's memfds); else this process does.
    flat_pages: scratch pages for flat-page batches. Raises ValueError (SGLang's pool does not
    fit its layout), HiCacheRpcError or OSError (the sidecar refused or is down)."""

    def __init__(
        self,
        client: HiCacheClient,
        host_pool: Any,
        geometry: KVGeometry,
        *,
        group: str,
        flat_pages: int,
        register_kw: dict[str, Any],
        direct: bool,
    ):
        self.client, self.host_pool, self.geometry, self.group = client, host_pool, geometry, group
        self.direct = direct
        self.layout = "sglang_" + host_pool.layout
        self.memory: SpanBuffer | None = None if direct else span_buffer(host_segments(host_pool))
        self._flat_size = flat_pages
        self._flat: FlatPages | None = None
        self._register_kw = {**register_kw, "group": group}
        self._lock = threading.Lock()
        try:
            self.info = self._register()
        except BaseException:
            self.close()
            raise

    @property
    def pool_id(self) -> str:
        return self.info.pool_id

    @property
    def host_pages(self) -> int:
        return self.info.host_pages

    @property
    def copy_path(self) -> str:
        """Who copies: "sidecar" (direct) or "engine" (this process), as the sidecar's stats say."""
        return "sidecar" if self.direct else "engine"

    def _register(self) -> RegisteredPool:
        pages = self.host_pool.page_num
        if self.memory is not None:
            return self.client.register_engine_copy(
                self.geometry, pages, self.memory, device_layout=self.layout, **self._register_kw
            )
        fds = list(self.host_pool.allocator.fds)  # SGLang's own memfds, in SGLang's own layout
        _, total = segment_offsets([os.fstat(fd).st_size for fd in fds])
        memory = MemoryHandle("fd", total, name=",".join(self.client.send_fds(fds)))
        return self.client.register_memory(self.geometry, pages, memory, device_layout=self.layout, **self._register_kw)

    def relink(self, stale: str) -> None:
        """Register again after the sidecar forgot pool `stale` (it restarted). The client
        forgets `stale` only once that succeeded: if it fails, calls still name `stale`, get
        NOT_FOUND from the sidecar and come here again."""
        with self._lock:
            if self.info.pool_id == stale:
                self.info = self._register()
                self.client.forget(stale)  # or the client would keep its secret and renew its lease
                if self._flat is not None:  # it maps the old pool's host memory
                    self._flat.close()
                    self._flat = None
                log.warning("hicache sidecar lost pool %s (restarted?); registered again as %s", stale, self.pool_id)

    def call(self, fn: Any) -> Any:
        """fn(pool_id); a NOT_FOUND for a forgotten pool re-registers and re-raises."""
        pool_id = self.pool_id
        try:
            return fn(pool_id)
        except HiCacheRpcError as exc:
            if exc.code.name == "NOT_FOUND" and "pool" in exc.details:
                self.relink(pool_id)
            raise

    def exists(self, keys: Sequence[bytes]) -> int:
        return int(self.call(lambda pid: self.client.lookup(keys, pool=pid)).prefix_length)

    def tiers(self, keys: Sequence[bytes]) -> list[bool]:
        found = self.call(lambda pid: self.client.lookup(keys, pool=pid))
        return [t.value != "none" for t in found.tiers]

    def get(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[bool]:
        """Reload keys into SGLang's host pages `pages`; True for the loaded prefix. Stops at
        the first miss: later pages are of no use to SGLang."""
        got = self.call(lambda pid: self.client.reload(list(keys), list(pages), pool=pid))
        n = loaded_prefix(got.statuses)
        return [True] * n + [False] * (len(keys) - n)

    def set(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[bool]:
        """Offload SGLang's host pages `pages` under keys; True where the sidecar holds the page now."""
        res = self.call(lambda pid: self.client.offload(list(keys), list(pages), pool=pid))
        return [s in KEPT for s in res.statuses]

    def get_flat(self, keys: Sequence[bytes], flats: Sequence[Any]) -> list[bool]:
        """Load keys into flat pages (see flat_pages); True for the loaded prefix."""
        return list(self.call(lambda pid: self._flat_pages(pid).get(keys, flats)))

    def set_flat(self, keys: Sequence[bytes], flats: Sequence[Any]) -> list[bool]:
        """Store flat pages under keys; True where the sidecar holds the page now."""
        return list(self.call(lambda pid: self._flat_pages(pid).set(keys, flats)))

    def _flat_pages(self, pool_id: str) -> FlatPages:
        """The flat-page copier of pool `pool_id`, made on first use (most SGLang setups use
        interface_v1 and never need its scratch pages)."""
        with self._lock:
            if self._flat is None and self.info.pool_id == pool_id:
                self._flat = FlatPages(self.client, self.info, self.geometry, self.layout, self._flat_size)
            if self._flat is None:
                raise ValueError(f"pool {pool_id} was registered again meanwhile")
            return self._flat

    def close(self) -> None:
        """Release what this link holds here (the client unregisters the pool)."""
        if self._flat is not None:
            self._flat.close()
            self._flat = None
        if self.memory is not None:
            self.memory.close()
