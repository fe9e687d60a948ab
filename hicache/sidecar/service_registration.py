"""How a pool joins and leaves the sidecar service: RegisterPool (the request checked, the
engine's memory mapped, the pool joined to the live host cache of its identity or given a
new one within the host budget), and release (UnregisterPool, an expired lease, a
registration whose caller gave up, shutdown)."""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hicache.api import PoolInfo
from hicache.geometry import KVGeometry
from hicache.memory import MemoryHandle, shm_dir
from hicache.sidecar.errors import NoSpace, StateError
from hicache.sidecar.registration import PoolRequest
from hicache.sidecar.request_cache import fingerprint
from hicache.sidecar.service_pools import ServicePools, sweep_dead
from hicache.sidecar.shared_cache import CacheIdentity, SharedHostCache

if TYPE_CHECKING:
    from hicache.sidecar.pool import RegisteredPool
    from hicache.sidecar.pool_factory import PoolParts

log = logging.getLogger("hicache.sidecar")
REGISTER = ("register", "")  # RegisterPool's scope in the request cache


class ServiceRegistration(ServicePools):
    """Registration and release of HiCacheService's pools."""

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
        sweep_dead()
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

    # ---- release ---------------------------------------------------------------------------------
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


def _pool_info(pool: RegisteredPool, req: PoolRequest, lease_timeout_s: float) -> PoolInfo:
    """What RegisterPool answers for a new pool."""
    identity, host, window = pool.identity, pool.host, pool.grants.window
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
        window.handle.name if window is not None else "",
        window.num_pages if window is not None else 0,
    )
