"""What a client holds for each pool it registered or attached: the sidecar's answer
(RegisteredPool), the pool's secret, its mapped progress block, CUDA events and engine
copier; how a call names a pool and carries its secret; and dropping a pool here (forget)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from hicache.api import POOL_SECRET

if TYPE_CHECKING:
    from hicache.client.connection import Connection
    from hicache.client.cuda_events import PoolCudaEvents
    from hicache.client.engine_copy import EngineCopy
    from hicache.client.progress_blocks import ProgressBlocks
    from hicache.rpc.generated import hicache_pb2_grpc as pb_grpc

T = TypeVar("T")


@dataclass(frozen=True)
class RegisteredPool:
    """The sidecar's answer to register(): ids, the host pool, and how keys are hashed."""

    pool_id: str
    group: str
    namespace: str
    page_size: int
    layer_num: int
    key_hash: str
    host_pages: int
    host_shm_name: str
    host_layout: str
    geometry_fingerprint: str
    lease_timeout_s: float
    secret: str = field(default="", repr=False)  # sent with every call naming the pool
    progress_shm_name: str = ""  # the pool's progress block (layer-wise reloads), "" for none
    window_shm_name: str = ""  # the copy window BeginCopy's offloads are written into
    window_pages: int = 0


PoolRef = RegisteredPool | str | None  # pool=: what register() returned, its pool_id, or the default


class ClientPools:
    """The pool bookkeeping of a HiCacheClient, which sets these attributes in __init__."""

    _conn: Connection
    _stub: pb_grpc.HiCacheStub
    target: str
    timeout: float
    retries: int
    _metadata: tuple[tuple[str, str], ...]
    _pools: dict[str, RegisteredPool]
    _secrets: dict[str, str]  # pool id -> secret, for this client's pools and attached ones
    _admin: str | None
    _default: str | None
    _blocks: ProgressBlocks  # the progress blocks of this client's pools, mapped
    _cuda_events: dict[str, PoolCudaEvents]  # CUDA pools: offload and layer events
    _copiers: dict[str, EngineCopy]  # pools whose copies run here (copy path "engine")

    # ---- plumbing -------------------------------------------------------------------------------
    def _call(
        self,
        method: Callable[..., T],
        request: Any,
        *,
        retry: bool = True,
        wait: bool = False,
        pool: str = "",
        timeout: float | None = None,
    ) -> T:
        """One call; naming `pool`, it carries the pool's secret. `timeout`: the deadline, if
        not the client's."""
        extra = ((POOL_SECRET, self._secrets.get(pool, "")),) if pool else ()
        return self._conn.call(method, request, retry=retry, wait=wait, extra=extra, timeout=timeout)

    def _pool_metadata(self, pool_id: str) -> tuple[tuple[str, str], ...]:
        return (*self._metadata, (POOL_SECRET, self._secrets.get(pool_id, "")))

    def attach(self, pool_id: str, secret: str) -> None:
        """Use a pool another client registered (a vLLM scheduler reads the pools its workers
        registered): lookup, prefetch, watch, pin and unpin then name it with its secret."""
        if not isinstance(pool_id, str) or not pool_id or not isinstance(secret, str) or not secret:
            raise ValueError(f"attach needs a pool id and its secret, got {pool_id!r}")
        self._secrets[pool_id] = secret

    def _pool(self, pool: PoolRef) -> RegisteredPool:
        pool_id = (pool.pool_id if isinstance(pool, RegisteredPool) else pool) or self._default
        if pool_id is None:
            raise ValueError("no pool registered: call register() first")
        if pool_id not in self._pools:
            raise KeyError(f"pool {pool_id!r} was not registered by this client")
        return self._pools[pool_id]

    def _pool_id(self, pool: PoolRef) -> str:
        """The pool a read or pin call names: one of this client's, or one it attached.
        Default: the default pool."""
        if isinstance(pool, RegisteredPool):
            return pool.pool_id
        return pool if pool is not None else self._pool(None).pool_id

    @staticmethod
    def _rid() -> str:
        return uuid.uuid4().hex

    def forget(self, pool: RegisteredPool | str) -> bool:
        """Drop one of this client's pools here only, with no call: its secret, progress block
        and CUDA events; keep-alive stops renewing it. For a pool the sidecar forgot (a call
        naming it got NOT_FOUND) before registering again. False if this client did not hold it."""
        pool_id = pool.pool_id if isinstance(pool, RegisteredPool) else pool
        if pool_id not in self._pools:
            return False
        del self._pools[pool_id]
        self._secrets.pop(pool_id, None)
        copier = self._copiers.pop(pool_id, None)
        if copier is not None:
            copier.close()
        self._blocks.unmap(pool_id)
        events = self._cuda_events.pop(pool_id, None)
        if events is not None:
            events.close()
        if self._default == pool_id:
            self._default = next(iter(self._pools), None)
        return True
