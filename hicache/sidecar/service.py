"""HiCacheService: the sidecar's logic, callable without gRPC.

It holds registered pools by id, checks each engine's geometry against the one the sidecar
derived from the model config, maps the engine's device memory, gives each registered pool a
host cache (one per model and rank slice, shared by every pool of that identity: see
hicache.sidecar.shared_cache), and serves offload / reload / prefetch / evict / lookup / pin calls.
Every mutating call takes a client-chosen request_id and is idempotent on retry. A pool
whose client stops calling for lease_timeout_s is reclaimed by reap_expired().

Errors follow hicache.sidecar.errors: ValueError / UnknownId (a KeyError) / StateError, and NoSpace returns.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from hicache.api import (
    CopyGrant,
    EvictResult,
    KeyStatus,
    LookupResult,
    OpEvent,
    PoolInfo,
    PoolStats,
    PrefetchOutcome,
    TransferResult,
)
from hicache.cache.prefetch import PrefetchHandle
from hicache.geometry import KVGeometry
from hicache.memory import CudaIpcOpens, FdStore, MemoryHandle, shm_dir, sweep_dead_segments
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.errors import NoSpace, StateError
from hicache.sidecar.events import EventBus, Subscription
from hicache.sidecar.health import degraded_but_serving, storage_health
from hicache.sidecar.host_budget import Claim, split
from hicache.sidecar.host_growth import HostGrower
from hicache.sidecar.operations import Operation, operation_events
from hicache.sidecar.pool_table import PoolTable
from hicache.sidecar.registration import PoolRequest, check_geometry
from hicache.sidecar.request_cache import RequestCache, fingerprint
from hicache.sidecar.shared_cache import CacheIdentity, SharedHostCache
from hicache.storage.factory import backend_reachable

if TYPE_CHECKING:
    from hicache.sidecar.pool import RegisteredPool
    from hicache.sidecar.pool_factory import PoolParts

log = logging.getLogger("hicache.sidecar")
REGISTER = ("register", "")  # RegisterPool's scope in the request cache


class HiCacheService:
    """Thread-safe. Call close() to release every pool (the server does on SIGTERM)."""

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
        _sweep()

    def add_release_hook(self, hook: Callable[[RegisteredPool], None]) -> None:
        """Call hook(pool) after each pool is released and closed (its transfers and storage
        writes done, its counters final), from the releasing thread; it must not block. What
        it raises is logged."""
        self._release_hooks.append(hook)

    # ---- registration -----------------------------------------------------------------------
    def register(
        self,
        request_id: str,
        *,
        geometry: KVGeometry,
        device_pages: int,
        device_memory: MemoryHandle,
        group: str = "full",
        namespace: str = "",
        model_id: str = "",
        key_hash: str = "sha256",
        cuda_device: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        device_layout: str = "",
        offload_events: Sequence[bytes] = (),
    ) -> PoolInfo | NoSpace:
        """Validate the geometry, map the device memory, create the host pool and its tier.

        Raises ValueError naming each geometry field that differs from the expected one, or
        a bad page count, memory handle, key hash, model id or TP rank. device_layout: "" for
        hicache's device pool, or the engine's own layout (EngineLayout) of memory it shares
        (fds it sent, or shm), which the sidecar then copies from directly. Returns NoSpace when
        the pool limit is reached or the host memory does not fit. offload_events: IPC handles
        of the engine's interprocess CUDA events that offloads may name to wait for (CUDA pools).

        A retry with the same request_id and arguments gets the first answer (the pool's id
        and secret) while the pool lives; once it is released, the id registers a new pool.
        The answer is not bound to the caller (see hicache.sidecar.request_cache).
        """
        req = PoolRequest(
            geometry,
            device_pages,
            device_memory,
            group,
            namespace,
            model_id,
            key_hash,
            cuda_device,
            tp_rank,
            tp_size,
            device_layout,
            tuple(offload_events),
        )
        return self._requests.run(
            REGISTER, request_id, fingerprint(repr(req), req.device_memory.proof), lambda: self._register(req)
        )

    def _register(self, req: PoolRequest) -> PoolInfo | NoSpace:
        req.check(self.config.expected, self.config.hierarchy.storage_backend)
        refusal = self._pools.refusal(req.namespace)
        if refusal:
            return self._refuse(refusal)
        from hicache.sidecar.pool_factory import make_parts  # torch: loaded with the first pool

        key = CacheIdentity.of(req)
        with contextlib.ExitStack() as undo:
            # Whatever a bad request fails on (its memory, its events, its tier) comes first:
            # the live pools give up host memory only to a pool that needs nothing else. A pool
            # that will join a live host cache makes no tier of its own.
            parts = make_parts(req, self.config, self._ipc, self.fds, with_tier=self._live_cache(key) is None)
            undo.callback(parts.close)
            # the budget split, the free-space check, the segment's reservation and the pool's
            # listing are one step: a concurrent registration sees this pool or none of it
            with self._space_lock:
                pool = self._join(req, parts, key)
                if isinstance(pool, NoSpace):
                    return pool
                undo.pop_all()  # the pool owns the parts now
                if key is not None:
                    self._caches[key] = pool.shared
                refusal = self._pools.add(pool)
                if refusal:
                    pool.close()
                    self._rebalance()
                    return self._refuse(refusal)
        self.host_growth.wake()
        return _pool_info(pool, req, self.config.lease_timeout_s)

    def _live_cache(self, key: CacheIdentity | None) -> SharedHostCache | None:
        """The live host cache of identity `key`, if any (a hint unless under the space lock)."""
        shared = self._caches.get(key) if key is not None else None
        return shared if shared is not None and not shared.closing else None

    def _join(self, req: PoolRequest, parts: PoolParts, key: CacheIdentity | None) -> RegisteredPool | NoSpace:
        """The pool as a member of the live host cache of its identity, or of a new one
        (_build). Under the space lock. Either way, dead processes' segments go first: a
        registration is the sweep's moment, whether or not it makes a host pool."""
        _sweep()
        shared = self._live_cache(key)
        if shared is None:
            return self._build(req, parts)
        from hicache.sidecar.pool_factory import join_pool

        try:
            pool = join_pool(req, parts, shared, self.config, self.events)
        except StateError:  # it began to close after it was looked up: a cache of its own
            return self._build(req, parts)
        self._rebalance()  # the cache's weight is its largest member's
        log.info("pool %s joined host cache %s (%d members)", pool.identity.pool_id, shared.cache_id, shared.members)
        return pool

    def _build(self, req: PoolRequest, parts: PoolParts) -> RegisteredPool | NoSpace:
        """The pool over `parts`, with its host pages taken from the budget (under the space
        lock). NoSpace, with every live pool's share given back, when they do not fit."""
        host_pages = self._host_pages(req)
        if isinstance(host_pages, NoSpace):
            return host_pages
        host_bytes = req.geometry.pool_bytes(host_pages)
        free = shutil.disk_usage(shm_dir()).free
        if host_bytes > free:
            self._rebalance()
            return NoSpace(f"host pool of {host_pages} pages needs {host_bytes} bytes, {shm_dir()} has {free} free")
        from hicache.sidecar.pool_factory import build_pool

        try:
            return build_pool(req, parts, host_pages, self.config, self.events)
        except OSError as exc:
            self._rebalance()  # the others get back what they gave up for it
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise
            return NoSpace(f"host pool of {host_pages} pages ({host_bytes} bytes): {exc.strerror}")
        except BaseException:
            self._rebalance()
            raise

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
            [*map(_claim, live), Claim(req.geometry.pool_bytes(req.device_pages), req.geometry.page_bytes)],
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

    def owns(self, pool_id: str, secret: str) -> bool:
        """Whether `secret` is the pool's (compared in constant time). Raises UnknownId for an
        unknown pool, so that a caller can tell a forgotten pool (NOT_FOUND) from another's."""
        return hmac.compare_digest(self._pools.peek(pool_id).identity.secret.encode(), secret.encode())

    def check_geometry(self, group: str, geometry: KVGeometry) -> None:
        """Raises ValueError for a group the model lacks or a geometry other than expected."""
        check_geometry(self.config.expected, group, geometry)

    def unregister(self, request_id: str, pool_id: str) -> bool:
        """Release the pool after its in-flight transfers. Raises KeyError for an unknown id."""
        return self._requests.run(("unregister", pool_id), request_id, "", lambda: self._release(pool_id))

    def _release(self, pool_id: str, *, only_expired: bool = False) -> bool:
        """Release the pool; with only_expired, only if its lease has run out (False if not).
        Raises KeyError for an unknown id."""
        # The pool stays listed until it is closed, so that a caller who sees it gone also
        # sees its memory released; meanwhile its calls get StateError (closing).
        pool = self._pools.end_expired_lease(pool_id) if only_expired else self._pools.end_lease(pool_id)
        if pool is None:
            return False  # renewed since it was listed (or released by another caller)
        # a retried registration must not be answered with this pool (its secret) any more
        self._requests.forget(REGISTER, lambda info: isinstance(info, PoolInfo) and info.pool_id == pool_id)
        try:
            pool.close()
        finally:  # a failed step still released what it could: the pool goes
            with self._space_lock:
                self._pools.remove(pool_id)
                key = pool.shared.identity
                if key is not None and pool.shared.closing and self._caches.get(key) is pool.shared:
                    del self._caches[key]
                self._rebalance()
            for hook in self._release_hooks:
                try:
                    hook(pool)
                except Exception:
                    log.exception("a release hook failed for pool %s", pool_id)
        return True

    # ---- leases -------------------------------------------------------------------------------
    def pool(self, pool_id: str) -> RegisteredPool:
        """The pool, with its lease renewed. Raises KeyError for an unknown id."""
        return self._pools.get(pool_id)

    def keep_alive(self, pool_id: str) -> float:
        """Renew the lease; returns the lease timeout in seconds."""
        self.pool(pool_id)
        return self.config.lease_timeout_s

    def extend_leases(self, seconds: float) -> None:
        """Add `seconds` to every pool's lease (see PoolTable.extend_leases) and to its open
        copy grants' time."""
        self._pools.extend_leases(seconds)
        for pool in self.pool_snapshots():
            pool.grants.extend(seconds)

    def reap_expired(self) -> list[str]:
        """Release every pool whose lease ran out; returns their ids. A lease renewed after
        the list was made, by a call or KeepAlive, keeps its pool. Copy grants past their time
        (an engine that died mid-copy while its pool lives on) end as failed."""
        for pool in self.pool_snapshots():
            try:
                pool.grants.expire()
            except Exception:
                log.exception("ending the expired copy grants of pool %s failed", pool.identity.pool_id)
        return [pool_id for pool_id in self._pools.expired() if self._release_logged(pool_id, only_expired=True)]

    def abandon(self, pool_id: str) -> bool:
        """Release a pool whose registration's caller gave up before the answer (its deadline
        passed): nobody holds its id or secret. False if it is gone already."""
        log.warning("released pool %s: its registration's caller gave up before the answer", pool_id)
        return self._release_logged(pool_id)

    def _release_logged(self, pool_id: str, *, only_expired: bool = False) -> bool:
        """_release for the reaper and close(), which must go on to the next pool: an unknown
        id is False, a failed close step is logged (the pool is released all the same)."""
        try:
            return self._release(pool_id, only_expired=only_expired)
        except KeyError:
            return False  # unregistered meanwhile
        except Exception:
            log.exception("releasing pool %s failed in a step; its other steps ran", pool_id)
            return True

    # ---- calls on a pool -------------------------------------------------------------------------
    def offload(
        self,
        request_id: str,
        pool_id: str,
        keys: Sequence[bytes],
        device_pages: Sequence[int],
        ready_event: int = 0,
    ) -> TransferResult:
        pool = self.pool(pool_id)
        args = fingerprint(list(keys), list(device_pages), ready_event)
        return self._requests.run(
            ("offload", pool_id), request_id, args, lambda: pool.offload(keys, device_pages, ready_event)
        )

    def reload(
        self,
        request_id: str,
        pool_id: str,
        keys: Sequence[bytes],
        device_pages: Sequence[int],
        *,
        layerwise: bool = False,
    ) -> TransferResult:
        pool = self.pool(pool_id)
        args = fingerprint(list(keys), list(device_pages), layerwise)
        return self._requests.run(
            ("reload", pool_id), request_id, args, lambda: pool.reload(keys, device_pages, layerwise=layerwise)
        )

    def begin_copy(self, request_id: str, pool_id: str, keys: Sequence[bytes], *, offload: bool) -> CopyGrant:
        """Host pages for the engine to copy into or out of itself (copy path "engine"; see
        RegisteredPool.begin_copy)."""
        pool = self.pool(pool_id)
        args = fingerprint(list(keys), offload)
        return self._requests.run(
            ("begin_copy", pool_id), request_id, args, lambda: pool.begin_copy(keys, offload=offload)
        )

    def end_copy(self, request_id: str, pool_id: str, grant_id: str, *, commit: bool, copy_seconds: float = 0.0) -> int:
        """End a grant of begin_copy; returns its pages. Raises UnknownId for an unknown or
        expired grant."""
        pool = self.pool(pool_id)
        args = fingerprint(grant_id, commit, copy_seconds)
        return self._requests.run(
            ("end_copy", pool_id),
            request_id,
            args,
            lambda: pool.end_copy(grant_id, commit=commit, copy_seconds=copy_seconds),
        )

    def prefetch(
        self, request_id: str, pool_id: str, keys: Sequence[bytes], policy: str | None = None
    ) -> PrefetchOutcome:
        """Storage -> host for `keys` (see RegisteredPool.prefetch); policy None or "" is the
        sidecar's --hicache-storage-prefetch-policy."""
        pool = self.pool(pool_id)
        return self._requests.run(
            ("prefetch", pool_id),
            request_id,
            fingerprint(list(keys), policy or ""),  # "" and None both mean the default
            lambda: pool.prefetch(keys, policy or None),
        )

    def evict(self, request_id: str, pool_id: str, keys: Sequence[bytes] = (), num_pages: int = 0) -> EvictResult:
        pool = self.pool(pool_id)
        args = fingerprint(list(keys), num_pages)
        return self._requests.run(("evict", pool_id), request_id, args, lambda: pool.evict(keys, num_pages))

    def lookup(self, pool_id: str, keys: Sequence[bytes]) -> LookupResult:
        return self.pool(pool_id).lookup(keys)

    def pin(self, request_id: str, pool_id: str, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
        pool = self.pool(pool_id)
        return self._requests.run(("pin", pool_id), request_id, fingerprint(list(keys)), lambda: pool.pin(keys))

    def unpin(self, request_id: str, pool_id: str, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
        pool = self.pool(pool_id)
        return self._requests.run(("unpin", pool_id), request_id, fingerprint(list(keys)), lambda: pool.unpin(keys))

    def stats(self, pool_id: str = "") -> list[PoolStats]:
        """One entry per pool, or for pool_id only. Raises KeyError for an unknown id."""
        if pool_id:
            return [self.pool(pool_id).stats()]
        return [p.stats() for p in self._pools.pools()]

    def operation(self, pool_id: str, op_id: str) -> Operation | PrefetchHandle:
        """Raises KeyError for an unknown pool or operation id."""
        return self.pool(pool_id).operation(op_id)

    def watch(
        self, pool_id: str, op_id: str, *, cancelled: Callable[[], bool] = lambda: False, poll_s: float = 0.25
    ) -> Iterator[OpEvent]:
        """Every event of the operation from its start, blocking for new ones, until it
        finishes or cancelled() is true. Raises KeyError for an unknown id."""
        return operation_events(self.operation(pool_id, op_id), cancelled, poll_s)

    # ---- KV events -----------------------------------------------------------------------------
    def subscribe(self, namespace: str | None = None, *, snapshot: bool = True) -> Subscription:
        """KV events of the pools in `namespace` (None: all) from now on. With snapshot, the
        subscription starts with POOL_REGISTERED and STORED(host, every resident key) of each
        such pool (see EventBus.subscribe)."""
        return self.events.subscribe(namespace, snapshot=snapshot)

    # ---- lifecycle ------------------------------------------------------------------------------
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

    def healthy(self) -> tuple[bool, str]:
        """(True, "") when every configured tier can serve; (False, why) while a registered
        pool's storage tier is down, or, before any pool registers, while the configured
        backend is unreachable (the gRPC health service then says NOT_SERVING)."""
        pools = self.pool_snapshots()
        if not pools:
            h = self.config.hierarchy
            return backend_reachable(h.storage_backend, h.storage_extra)
        return storage_health(pools)

    def degraded_but_serving(self) -> tuple[bool, str]:
        """healthy() for a sidecar whose storage tier is optional: logs what is down but
        always answers serving, since host memory still serves."""
        pools = self.pool_snapshots()
        if pools:
            return degraded_but_serving(pools)
        ok, why = self.healthy()
        if not ok:
            log.warning("storage degraded, still serving from host memory: %s", why)
        return True, ""

    def close(self) -> None:
        """Refuse new registrations and release every pool after its in-flight work, then end
        every event subscription. Idempotent."""
        self.host_growth.close()
        for pool_id in self._pools.shut():
            self._release_logged(pool_id)
        self.events.close()

    def check_integrity(self) -> None:
        for pool in self._pools.check_integrity():
            pool.check_integrity()


def _pool_info(pool: RegisteredPool, req: PoolRequest, lease_timeout_s: float) -> PoolInfo:
    """What RegisterPool answers for a new pool."""
    identity, host = pool.identity, pool.host
    return PoolInfo(
        identity.pool_id,
        host.num_pages,
        host.handle.name,
        host.layout_name,
        host.nbytes,
        req.geometry.fingerprint,
        req.key_hash,
        identity.key_bytes,
        lease_timeout_s,
        identity.secret,
        pool.progress.name if pool.progress is not None else "",
        pool.progress.nbytes if pool.progress is not None else 0,
        tuple(pool.layer_events.handles) if pool.layer_events is not None else (),
        pool.layer_events.slots if pool.layer_events is not None else 0,
    )


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
    return Claim(shared.device_bytes, g.page_bytes, shared.host.num_pages)


def _sweep() -> None:
    """Remove the shared memory of processes killed before they could (kill -9 of an engine
    or of an earlier sidecar)."""
    gone = sweep_dead_segments()
    if gone:
        log.warning("removed %d shared-memory segments of dead processes: %s", len(gone), ", ".join(gone[:8]))
