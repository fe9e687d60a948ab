"""Building a registered pool: map the engine's memory, create the host pool, its storage
tier and its cache; on any failure, release what was made so far."""

from __future__ import annotations

import contextlib
import secrets

from hicache.api import EventPool
from hicache.keys import KEY_BYTES
from hicache.memory import CudaIpcOpens, FdStore
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.sidecar.config import IO_BACKENDS, ServiceConfig
from hicache.sidecar.events import EventBus, PoolEvents
from hicache.sidecar.pool import RegisteredPool
from hicache.sidecar.registration import PoolIdentity, PoolRequest, map_device, map_engine_layout


def build_pool(
    req: PoolRequest, host_pages: int, config: ServiceConfig, ipc: CudaIpcOpens, fds: FdStore, bus: EventBus
) -> RegisteredPool:
    """The pool `req` asks for, with host_pages host pages. Raises ValueError for memory that
    cannot be mapped (and whatever the tier raises), with nothing left allocated."""
    with contextlib.ExitStack() as undo:
        device: DeviceKVPool
        if req.device_layout:
            device = map_engine_layout(
                req.geometry, req.device_pages, req.device_memory, req.device_layout, fds, ipc, req.cuda_device
            )
        else:
            device = map_device(req.geometry, req.device_pages, req.device_memory, req.cuda_device, ipc)
        undo.callback(device.close)
        offload_events = None
        if req.offload_events:
            from hicache.memory.cuda_events import OpenedIpcEvents

            offload_events = OpenedIpcEvents(req.offload_events, req.cuda_device, "offload_event_handles")
            undo.callback(offload_events.close)
        host = HostKVPool(req.geometry, host_pages, config.host_layout)
        undo.callback(host.close)
        tier = config.hierarchy.make_tier(req.geometry, req.stored_model_id, req.namespace)
        undo.callback(tier.close)
        cache = config.hierarchy.build(host, tier)
        undo.callback(cache.close)
        identity = PoolIdentity(
            "pool-" + secrets.token_hex(8),
            req.group,
            req.namespace,
            req.model_id,
            req.key_hash,
            KEY_BYTES[req.key_hash],
            secrets.token_hex(16),
            f"tp{req.tp_rank}of{req.tp_size}",
        )
        pool = RegisteredPool(
            identity,
            device,
            cache,
            max_batch=config.max_batch,
            finished_ops_kept=config.finished_ops_kept,
            io_backend=IO_BACKENDS[config.io_backend],
            events=PoolEvents(
                bus, EventPool(identity.pool_id, req.namespace, req.model_id, req.group, req.tp_rank, req.tp_size)
            ),
            offload_events=offload_events,
            layerwise_inline_bytes=config.layerwise_inline_bytes,
        )
        undo.pop_all()
        return pool
