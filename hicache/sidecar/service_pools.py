"""What the sidecar service holds: its registered pools (a PoolTable, whose leases a call
renews), the host caches they share, the request cache and the KV event bus, and the split
of the host budget (--hicache-size) among the live host caches."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.memory import CudaIpcOpens, FdStore, sweep_dead_segments
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.errors import NoSpace, StateError
from hicache.sidecar.events import EventBus
from hicache.sidecar.host_budget import Claim, split
from hicache.sidecar.host_growth import HostGrower
from hicache.sidecar.pool_table import PoolTable
from hicache.sidecar.registration import PoolRequest
from hicache.sidecar.request_cache import RequestCache
from hicache.sidecar.shared_cache import CacheIdentity, SharedHostCache

if TYPE_CHECKING:
    from hicache.sidecar.pool import RegisteredPool

log = logging.getLogger("hicache.sidecar")


class ServicePools:
    """The state HiCacheService's parts share: the pool table, the shareable host caches, the
    request cache, the event bus and the host budget."""

    def __init__(
        self, config: ServiceConfig, *, clock: Callable[[], float] = time.monotonic, fds: FdStore | None = None
    ):
        """`fds`: where fds that engines sent wait for their registration (the server's fd
        socket fills it); one of its own by default."""
        self.config = config
        self.fds = fds if fds is not None else FdStore()
        self._clock = clock
        self._pools = PoolTable(config.lease_timeout_s, config.max_pools, clock, config.max_pools_per_namespace)
        self._requests = RequestCache(config.request_cache_size)
        self._ipc = CudaIpcOpens()
        self._space_lock = threading.Lock()  # one pool at a time checks /dev/shm and reserves in it
        self._caches: dict[CacheIdentity, SharedHostCache] = {}  # the shareable ones (under the space lock)
        self.host_growth = HostGrower(self._space_lock, self.cache_snapshots)  # caches reserve in steps
        self.events = EventBus()
        self._release_hooks: list[Callable[[RegisteredPool], None]] = []
        sweep_dead()

    def add_release_hook(self, hook: Callable[[RegisteredPool], None]) -> None:
        """Call hook(pool) after each pool is released and closed (its transfers and storage
        writes done, its counters final), from the releasing thread; it must not block. What
        it raises is logged."""
        self._release_hooks.append(hook)

    # ---- leases -------------------------------------------------------------------------------
    def pool(self, pool_id: str) -> RegisteredPool:
        """The pool, with its lease renewed. Raises KeyError for an unknown id."""
        return self._pools.get(pool_id)

    # ---- the pools and host caches ---------------------------------------------------------------
    @property
    def pool_ids(self) -> list[str]:
        return self._pools.ids()

    def pool_snapshots(self) -> list[RegisteredPool]:
        """Every open registered pool, renewing no lease (for metrics and health checks)."""
        return [p for p in self._pools.pools() if not p.closed]

    def cache_snapshots(self) -> list[SharedHostCache]:
        """Every open host cache (each once, however many pools share it)."""
        caches = {id(p.shared): p.shared for p in self.pool_snapshots()}
        return [c for c in caches.values() if not c.closing]

    # ---- the host budget ------------------------------------------------------------------------
    def _host_pages(self, req: PoolRequest) -> int | NoSpace:
        """The new pool's host pages: --hicache-ratio x its device pages, or, with a sidecar
        budget (--hicache-size), its share (host_budget), after shrinking the live pools to
        theirs. NoSpace when a share would hold no page."""
        h = self.config.hierarchy
        if h.size_gb <= 0:
            return self.config.host_pages_for(req.geometry, req.device_pages)
        live = self.cache_snapshots()
        shares = split(
            self._budget,
            [
                *map(_claim, live),
                Claim(req.geometry.pool_bytes(req.device_pages), req.geometry.page_bytes, None, req.namespace),
            ],
        )
        if min(shares) < 1:
            return NoSpace(
                f"the sidecar's host budget (--hicache-size {h.size_gb:g} GB) split over {len(shares)} pools "
                f"leaves a share of less than one page ({req.geometry.page_bytes} bytes) for a pool"
            )
        for shared, pages in zip(live, shares, strict=False):
            _move_goal(shared, pages)
        return shares[-1]

    @property
    def _budget(self) -> int:
        return int(self.config.hierarchy.size_gb * 1e9)

    def _rebalance(self) -> None:
        """Give each live host cache its share of the budget again (after a pool came or left,
        or a registration that failed): a cache above it shrinks now, one below grows to it in
        the background (a cache that cannot grow, ENOSPC, keeps its size)."""
        if self.config.hierarchy.size_gb <= 0:
            return
        live = self.cache_snapshots()
        if not live:
            return
        for shared, pages in zip(live, split(self._budget, [_claim(c) for c in live]), strict=True):
            if pages >= 1:
                _move_goal(shared, pages)
        self.host_growth.wake()

    def _refuse(self, why: str) -> NoSpace:
        """StateError once shut down; otherwise the pool limit, a NoSpace answer."""
        if self._pools.closed:
            raise StateError(why)
        return NoSpace(why)


def _move_goal(shared: SharedHostCache, pages: int) -> None:
    """Make `pages` the cache's host goal: above it, it shrinks now; below it, the HostGrower
    grows it (under the space lock, as here)."""
    shared.host_goal = pages
    if pages < shared.host_pages:
        _resize(shared, pages)


def _resize(shared: SharedHostCache, pages: int) -> None:
    """shared.resize_host, for a rebalance: a cache that cannot grow (ENOSPC) keeps its size,
    and one closing meanwhile is skipped (its budget comes back when it is gone)."""
    try:
        shared.resize_host(pages)
    except (OSError, StateError) as exc:
        log.warning("host cache %s keeps %d host pages: %s", shared.cache_id, shared.host_pages, exc)


def _claim(shared: SharedHostCache) -> Claim:
    g = shared.geometry
    return Claim(shared.device_bytes, g.page_bytes, shared.host.num_pages, shared.namespace)


def sweep_dead() -> None:
    """Remove the shared memory of processes killed before they could (kill -9 of an engine
    or of an earlier sidecar)."""
    gone = sweep_dead_segments()
    if gone:
        log.warning("removed %d shared-memory segments of dead processes: %s", len(gone), ", ".join(gone[:8]))
