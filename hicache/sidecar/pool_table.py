"""The service's registered pools by id, each with its lease deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.sidecar.errors import UnknownId

if TYPE_CHECKING:
    from hicache.sidecar.pool import RegisteredPool


class PoolTable:
    """Thread-safe. A pool's lease is renewed by every lookup of it (get) and expires
    `lease_s` after the last one; once closed, the table takes no new pools."""

    def __init__(
        self, lease_s: float, max_pools: int, clock: Callable[[], float], max_per_namespace: int | None = None
    ):
        self.lease_s = lease_s
        self.max_pools = max_pools
        self.max_per_namespace = max_pools if max_per_namespace is None else max_per_namespace
        self._clock = clock
        self._lock = threading.Lock()  # guards _pools, _leases and closed
        self._pools: dict[str, RegisteredPool] = {}
        self._leases: dict[str, float] = {}  # pool id -> deadline on self._clock
        self.closed = False

    def refusal(self, namespace: str) -> str:
        """Why a new pool in `namespace` cannot be added now ("" if it can)."""
        with self._lock:
            return self._refusal_locked(namespace)

    def _refusal_locked(self, namespace: str) -> str:
        if self.closed:
            return "the service is shut down"
        if len(self._pools) >= self.max_pools:
            return f"{len(self._pools)} pools registered, the limit is {self.max_pools} (--max-pools)"
        mine = sum(p.identity.namespace == namespace for p in self._pools.values())
        if mine >= self.max_per_namespace:
            return (
                f"namespace {namespace!r} holds {mine} pools, the quota of one namespace is "
                f"{self.max_per_namespace} (--max-pools-per-namespace)"
            )
        return ""

    def add(self, pool: RegisteredPool) -> str:
        """Add the pool with a fresh lease; returns "" or, adding nothing, why not (checked
        again here: another registration or close() may have come first)."""
        with self._lock:
            refusal = self._refusal_locked(pool.identity.namespace)
            if not refusal:
                self._pools[pool.identity.pool_id] = pool
                self._leases[pool.identity.pool_id] = self._clock() + self.lease_s
            return refusal

    def get(self, pool_id: str) -> RegisteredPool:
        """The pool, with its lease renewed. Raises UnknownId (a KeyError) for an unknown id."""
        with self._lock:
            pool = self._pools.get(pool_id)
            if pool is None:
                raise UnknownId(f"unknown pool id {pool_id!r}")
            if pool_id in self._leases:  # not while it is being released
                self._leases[pool_id] = self._clock() + self.lease_s
            return pool

    def end_lease(self, pool_id: str) -> RegisteredPool:
        """Stop renewing the pool's lease (it is being released; it stays listed until
        remove()). Raises UnknownId for an unknown id."""
        with self._lock:
            pool = self._pools.get(pool_id)
            self._leases.pop(pool_id, None)
        if pool is None:
            raise UnknownId(f"unknown pool id {pool_id!r}")
        return pool

    def end_expired_lease(self, pool_id: str) -> RegisteredPool | None:
        """end_lease(pool_id) if its lease has run out now, checked under the lock that a
        renewal takes; None (nothing changed) if it was renewed since expired() listed it,
        or is gone or being released already."""
        now = self._clock()
        with self._lock:
            deadline = self._leases.get(pool_id)
            if deadline is None or deadline >= now:
                return None
            del self._leases[pool_id]
            return self._pools[pool_id]

    def remove(self, pool_id: str) -> None:
        with self._lock:
            self._pools.pop(pool_id, None)

    def extend_leases(self, seconds: float) -> None:
        """Push every lease's deadline `seconds` later: time the sidecar was not running
        (stopped, starved, a paused VM) is no engine's silence."""
        with self._lock:
            for pool_id in self._leases:
                self._leases[pool_id] += seconds

    def expired(self) -> list[str]:
        """Ids of the pools whose lease ran out."""
        now = self._clock()
        with self._lock:
            return [pid for pid, deadline in self._leases.items() if deadline < now]

    def peek(self, pool_id: str) -> RegisteredPool:
        """The pool, lease untouched. Raises UnknownId for an unknown id."""
        with self._lock:
            pool = self._pools.get(pool_id)
        if pool is None:
            raise UnknownId(f"unknown pool id {pool_id!r}")
        return pool

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._pools)

    def pools(self) -> list[RegisteredPool]:
        with self._lock:
            return list(self._pools.values())

    def shut(self) -> list[str]:
        """Take no new pools from now on; returns the ids listed now."""
        with self._lock:
            self.closed = True
            return list(self._pools)

    def check_integrity(self) -> list[RegisteredPool]:
        with self._lock:
            assert set(self._pools) == set(self._leases)
            return list(self._pools.values())
