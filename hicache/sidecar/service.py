"""HiCacheService: the sidecar's logic, callable without gRPC.

It holds registered pools by id, checks each engine's geometry against the one the sidecar
derived from the model config, maps the engine's device memory, gives each registered pool a
host cache (one per model and rank slice, shared by every pool of that identity: see
hicache.sidecar.shared_cache), and serves offload / reload / prefetch / evict / lookup / pin calls.
Every mutating call takes a client-chosen request_id and is idempotent on retry. A pool
whose client stops calling for lease_timeout_s is reclaimed by reap_expired().

Errors follow hicache.sidecar.errors: ValueError / UnknownId (a KeyError) / StateError, and NoSpace returns.
What the service holds and the host budget are in service_pools.py, registration and
release in service_registration.py; here are the calls on a pool, health and close.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterator, Sequence

from hicache.api import (
    CopyGrant,
    EvictResult,
    KeyStatus,
    LookupResult,
    OpEvent,
    PoolInfo,  # noqa: F401 (tests import it from here)
    PoolStats,
    PrefetchOutcome,
    TransferResult,
)
from hicache.cache.prefetch import PrefetchHandle
from hicache.geometry import KVGeometry
from hicache.sidecar.events import Subscription
from hicache.sidecar.health import degraded_but_serving, storage_health
from hicache.sidecar.operations import Operation, operation_events
from hicache.sidecar.registration import check_geometry
from hicache.sidecar.request_cache import fingerprint
from hicache.sidecar.service_registration import ServiceRegistration
from hicache.storage.factory import backend_reachable

log = logging.getLogger("hicache.sidecar")


class HiCacheService(ServiceRegistration):
    """Thread-safe. Call close() to release every pool (the server does on SIGTERM)."""

    def owns(self, pool_id: str, secret: str) -> bool:
        """Whether `secret` is the pool's (compared in constant time). Raises UnknownId for an
        unknown pool, so that a caller can tell a forgotten pool (NOT_FOUND) from another's."""
        return hmac.compare_digest(self._pools.peek(pool_id).identity.secret.encode(), secret.encode())

    def check_geometry(self, group: str, geometry: KVGeometry) -> None:
        """Raises ValueError for a group the model lacks or a geometry other than expected."""
        check_geometry(self.config.expected, group, geometry)

    # ---- leases -------------------------------------------------------------------------------
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

    # ---- health and lifecycle -----------------------------------------------------------------
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
