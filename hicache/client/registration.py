"""Registering and unregistering a client's pools: a device pool, memory the engine lays
out itself (shm, fds it sends, CUDA IPC), or memory the sidecar cannot map, which this
process then copies itself (copy path "engine", with BeginCopy / EndCopy grants)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from hicache.api import CopyGrant
from hicache.client.client_pools import ClientPools, PoolRef, RegisteredPool
from hicache.client.cuda_events import PoolCudaEvents
from hicache.client.handles import HiCacheRpcError
from hicache.geometry import KVGeometry
from hicache.keys import HashName
from hicache.memory import MemoryHandle, SharedBuffer, cuda_available, cuda_index, send_fds
from hicache.rpc import convert
from hicache.rpc.generated import hicache_pb2 as pb

if TYPE_CHECKING:
    from hicache.pools import DeviceKVPool

log = logging.getLogger("hicache.client")


class PoolRegistration(ClientPools):
    """The registration calls of a HiCacheClient."""

    # ---- registration -----------------------------------------------------------------------------
    def register(
        self,
        device_pool: DeviceKVPool,
        *,
        namespace: str = "",
        model_id: str = "",
        group: str = "full",
        key_hash: HashName = "sha256",
        cuda_device: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> RegisteredPool:
        """Register `device_pool` (one KV group) and make it the default pool. The pool must be
        shareable: a CPU pool in shared memory or a CUDA pool exported with CUDA IPC. With
        tensor parallelism each rank registers its own pool with its tp_rank: ranks hold
        different KV heads under the same page keys, so their stored pages are kept apart.
        cuda_device: the pool's CUDA device index, by default the one its memory is on.
        A pool the sidecar cannot map (private memory: memory kind "local") is registered
        with the copy path "engine" (register_engine_copy), and the choice is logged."""
        if device_pool.handle.kind == "local":
            log.info("device pool is in private memory: this process copies it (copy path 'engine')")
            return self.register_engine_copy(
                device_pool.geometry,
                device_pool.num_pages,
                device_pool.memory,
                namespace=namespace,
                model_id=model_id,
                group=group,
                key_hash=key_hash,
                tp_rank=tp_rank,
                tp_size=tp_size,
            )
        if cuda_device is None:
            cuda_device = cuda_index(str(device_pool.flat.device)) if device_pool.flat.is_cuda else 0
        return self.register_memory(
            device_pool.geometry,
            device_pool.num_pages,
            device_pool.handle,
            namespace=namespace,
            model_id=model_id,
            group=group,
            key_hash=key_hash,
            cuda_device=cuda_device,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def register_memory(
        self,
        geometry: KVGeometry,
        num_pages: int,
        memory: MemoryHandle,
        *,
        device_layout: str = "",
        namespace: str = "",
        model_id: str = "",
        group: str = "full",
        key_hash: HashName = "sha256",
        cuda_device: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        wait: bool = True,
    ) -> RegisteredPool:
        """register() for memory the engine lays out itself: num_pages pages of `geometry` in
        `memory` (shm by name, or kind "fd" with the ids send_fds returned), laid out as
        `device_layout` (an EngineLayout name, e.g. "sglang_page_first"; "" is hicache's
        layer_first). The sidecar then copies straight from and to the engine's pages.
        `wait`: wait up to the deadline for a sidecar that is not up yet (False: a sidecar
        that is down fails the call at once with UNAVAILABLE)."""
        if not isinstance(namespace, str):
            raise ValueError(f"namespace must be a str, got {type(namespace).__name__}")
        # a CUDA pool's offloads wait for the caller's stream on the GPU, through these events
        events = PoolCudaEvents.create(cuda_device) if memory.kind == "cuda_ipc" and cuda_available() else None
        request = pb.RegisterPoolRequest(
            request_id=self._rid(),
            group=group,
            geometry=convert.geometry_to_pb(geometry),
            device_pages=num_pages,
            device_memory=convert.memory_to_pb(memory, cuda_device),
            namespace=namespace,
            model_id=model_id,
            key_hash=key_hash,
            tp_rank=tp_rank,
            tp_size=tp_size,
            device_layout=device_layout,
            offload_event_handles=events.offload.handles if events is not None else [],
        )
        try:
            r = self._call(self._stub.RegisterPool, request, wait=wait)
        except BaseException:
            if events is not None:
                events.close()
            raise
        if events is not None:
            events.open_layer_events(r.layer_event_handles, r.layer_event_slots)  # Watch if it cannot
        g = geometry
        info = RegisteredPool(
            r.pool_id,
            group,
            namespace,
            g.page_size,
            g.layer_num,
            r.key_hash,
            r.host_pages,
            r.host_shm_name,
            r.host_layout,
            r.geometry_fingerprint,
            r.lease_timeout.ToNanoseconds() / 1e9,
            r.pool_secret,
            r.progress_shm_name,
            r.window_shm_name,
            r.window_pages,
        )
        self._pools[info.pool_id] = info
        self._secrets[info.pool_id] = r.pool_secret
        self._blocks.map(info.pool_id, r.progress_shm_name, r.progress_nbytes)
        if events is not None:
            self._cuda_events[info.pool_id] = events
        self._default = info.pool_id
        self._conn.keep_alive(lambda: [(p, i.secret) for p, i in list(self._pools.items())], info.lease_timeout_s)
        return info

    def register_engine_copy(
        self,
        geometry: KVGeometry,
        num_pages: int,
        memory: SharedBuffer,
        *,
        device_layout: str = "",
        namespace: str = "",
        model_id: str = "",
        group: str = "full",
        key_hash: HashName = "sha256",
        tp_rank: int = 0,
        tp_size: int = 1,
        wait: bool = True,
    ) -> RegisteredPool:
        """register_memory() for memory the sidecar cannot map (a private allocation, a CUDA
        pool that cannot be exported): num_pages pages of `geometry` in `memory`, laid out as
        `device_layout` (memory of several allocations, a memory.SpanBuffer, holds one of the
        layout's buffers in each: SGLang's K and V host buffers). This process maps the
        sidecar's host pool and copies itself, and offload() / reload() on the pool run here;
        the sidecar keeps the index, eviction, tiers and pins, and publishes an offloaded page
        only once its copy is done (see hicache.client.engine_copy). Raises ValueError for
        memory too small for the layout, or segments that do not match it, before anything is
        registered."""
        from hicache.client.engine_copy import EngineCopy, local_pool  # torch: loaded with the first pool

        device = local_pool(geometry, num_pages, memory, device_layout)
        info = self.register_memory(
            geometry,
            num_pages,
            MemoryHandle("engine", 0),
            namespace=namespace,
            model_id=model_id,
            group=group,
            key_hash=key_hash,
            tp_rank=tp_rank,
            tp_size=tp_size,
            wait=wait,
        )
        pool_id = info.pool_id
        try:
            copier = EngineCopy.attach(
                device,
                info.host_shm_name,
                info.host_pages,
                info.host_layout,
                info.window_shm_name,
                info.window_pages,
                lambda keys, offload: self.begin_copy(keys, offload=offload, pool=pool_id),
                lambda grant_id, commit, seconds: self.end_copy(
                    grant_id, commit=commit, copy_seconds=seconds, pool=pool_id
                ),
            )
        except BaseException:
            self.unregister(info, retry=False)
            raise
        self._copiers[pool_id] = copier
        return info

    def begin_copy(self, keys: Sequence[bytes], *, offload: bool, pool: PoolRef = None) -> CopyGrant:
        """BeginCopy: host pages for this process to copy into (offload) or out of (reload)
        itself; end each grant with end_copy. register_engine_copy's pools call it for you."""
        pool_id = self._pool_id(pool)
        req = pb.BeginCopyRequest(request_id=self._rid(), pool_id=pool_id, keys=list(keys), offload=offload)
        r = self._call(self._stub.BeginCopy, req, pool=pool_id)
        statuses = convert.statuses_from_pb(r.statuses)
        return CopyGrant(statuses, tuple(r.host_pages), r.grant_id, r.expires_in.ToNanoseconds() / 1e9)

    def end_copy(self, grant_id: str, *, commit: bool, copy_seconds: float = 0.0, pool: PoolRef = None) -> int:
        """EndCopy: publish an offload grant's pages (commit) or give them back; end a reload
        grant's hold. Returns its pages."""
        pool_id = self._pool_id(pool)
        req = pb.EndCopyRequest(
            request_id=self._rid(), pool_id=pool_id, grant_id=grant_id, commit=commit, copy_seconds=copy_seconds
        )
        return int(self._call(self._stub.EndCopy, req, pool=pool_id).pages)

    def send_fds(self, fds: Sequence[int]) -> list[str]:
        """Hand memfd/shm fds to the sidecar (Unix socket targets only, same uid); returns the
        ids for a MemoryHandle("fd", nbytes, name=",".join(ids)). Raises ValueError or OSError."""
        if not self.target.startswith("unix://"):
            raise ValueError(f"fds can be sent only to a sidecar on a Unix socket, not {self.target!r}")
        return send_fds(self.target.removeprefix("unix://"), fds, timeout=self.timeout)

    def unregister(self, pool: PoolRef = None, *, retry: bool = True, timeout: float | None = None) -> bool:
        """Unregister one of this client's pools (default: the default pool) and drop it here:
        its secret, mapped progress block and CUDA events. True if the sidecar unregistered it;
        False if the sidecar no longer knew it (it restarted, or the lease expired): the pool
        is dropped here all the same, so a re-registration leaves no stale pool behind.
        Raises KeyError for a pool this client did not register, HiCacheRpcError for any
        other failure (the pool is then kept). `timeout`: the deadline, if not the client's."""
        info = self._pool(pool)
        request = pb.UnregisterPoolRequest(request_id=self._rid(), pool_id=info.pool_id)
        try:
            self._call(self._stub.UnregisterPool, request, retry=retry, pool=info.pool_id, timeout=timeout)
            known = True
        except HiCacheRpcError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            known = False  # the sidecar forgot it: nothing there to undo
        self.forget(info)
        return known
