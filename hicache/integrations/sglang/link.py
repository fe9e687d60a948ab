"""One SGLang host pool linked to one sidecar pool: its geometry, its registration (redone
after a sidecar restart), and the page moves of a batch.

Two ways to move pages:
- direct (zero-copy): SGLang's host pool lives in memfds ("allocator": "shm"); their fds go
  to the sidecar, which maps the pool in SGLang's own layout and copies straight between it
  and its host pool. Offload/Reload name SGLang's host page numbers.
- staging: otherwise; pages go through a staging pool of hicache's layout in this process,
  registered once (one copy more on each side).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from hicache.api import KeyStatus
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.geometry import KVGeometry
from hicache.integrations.sglang.pool_views import LayerViews, page_views
from hicache.integrations.sglang.staging import StagingArea
from hicache.memory import MemoryHandle, segment_offsets
from hicache.pools import DeviceKVPool

log = logging.getLogger("hicache.integrations.sglang")
LOADED = (KeyStatus.LOADED, KeyStatus.LOADED_FROM_STORAGE)
KEPT = (KeyStatus.STORED, KeyStatus.DEDUPLICATED)


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
    """Thread-safe: gets and sets each have their own staging area and lock."""

    def __init__(
        self,
        client: HiCacheClient,
        host_pool: Any,
        geometry: KVGeometry,
        *,
        group: str,
        staging_pages: int,
        register_kw: dict[str, Any],
        direct: bool,
    ):
        self.client, self.host_pool, self.geometry, self.group = client, host_pool, geometry, group
        self.direct = direct
        self.views: LayerViews = page_views(host_pool)
        self.staging: DeviceKVPool | None = None
        if not direct:
            self.staging = DeviceKVPool(geometry, 2 * staging_pages)
            self.set_area = StagingArea(self.staging, 0, staging_pages)
            self.get_area = StagingArea(self.staging, staging_pages, staging_pages)
        self._register_kw = {**register_kw, "group": group}
        self._lock = threading.Lock()
        try:
            self.pool_id, self.host_pages = self._register()
        except BaseException:
            self.close()
            raise

    def _register(self) -> tuple[str, int]:
        if self.staging is not None:
            info = self.client.register(self.staging, **self._register_kw)
        else:  # SGLang's own memfds, in SGLang's own layout
            fds = list(self.host_pool.allocator.fds)
            _, total = segment_offsets([os.fstat(fd).st_size for fd in fds])
            ids = self.client.send_fds(fds)
            memory = MemoryHandle("fd", total, name=",".join(ids))
            layout = "sglang_" + self.host_pool.layout
            info = self.client.register_memory(
                self.geometry, self.host_pool.page_num, memory, device_layout=layout, **self._register_kw
            )
        return info.pool_id, info.host_pages

    def relink(self, stale: str) -> None:
        """Register again after the sidecar forgot pool `stale` (it restarted). The client
        forgets `stale` only once that succeeded: if it fails, calls still name `stale`, get
        NOT_FOUND from the sidecar and come here again."""
        with self._lock:
            if self.pool_id == stale:
                self.pool_id, self.host_pages = self._register()
                self.client.forget(stale)  # or the client would keep its secret and renew its lease
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

    def get(self, keys: Sequence[bytes], pages: Sequence[int], views: LayerViews | None = None) -> list[bool]:
        """Reload keys into host pages `pages` (of `views`, default the pool); True for the
        loaded prefix. Stops at the first miss: later pages are of no use to SGLang."""
        if self.direct and views is None:
            got = self.call(lambda pid: self.client.reload(list(keys), list(pages), pool=pid))
            n = next((i for i, s in enumerate(got.statuses) if s not in LOADED), len(keys))
            return [True] * n + [False] * (len(keys) - n)
        out = [False] * len(keys)
        area, views = self._area("get"), views if views is not None else self.views
        for start in range(0, len(keys), area.size):
            ks, ps = list(keys[start : start + area.size]), list(pages[start : start + area.size])
            with area.lock:
                got = self.call(lambda pid, ks=ks: self.client.reload(ks, area.pages(len(ks)), pool=pid))
                n = next((i for i, s in enumerate(got.statuses) if s not in LOADED), len(ks))
                area.scatter(views, ps[:n])
            out[start : start + n] = [True] * n
            if n < len(ks):
                break
        return out

    def set(self, keys: Sequence[bytes], pages: Sequence[int], views: LayerViews | None = None) -> list[bool]:
        """Offload host pages `pages` under keys; True where the sidecar holds the page now."""
        if self.direct and views is None:
            res = self.call(lambda pid: self.client.offload(list(keys), list(pages), pool=pid))
            return [s in KEPT for s in res.statuses]
        out: list[bool] = []
        area, views = self._area("set"), views if views is not None else self.views
        for start in range(0, len(keys), area.size):
            ks, ps = list(keys[start : start + area.size]), list(pages[start : start + area.size])
            with area.lock:
                area.gather(views, ps)
                res = self.call(lambda pid, ks=ks: self.client.offload(ks, area.pages(len(ks)), pool=pid))
            out += [s in KEPT for s in res.statuses]
        return out

    def _area(self, direction: str) -> StagingArea:
        """The staging area for `direction`. A direct link has none: SGLang's flat-page methods
        (used without interface_v1) then answer misses."""
        with self._lock:
            if self.staging is None:
                raise ValueError("flat pages need a staging pool; this link copies SGLang's pages directly")
        return self.set_area if direction == "set" else self.get_area

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
