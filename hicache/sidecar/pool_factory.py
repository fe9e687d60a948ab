"""Building a registered pool in two steps: first what a bad request can fail on (the engine's
memory, its offload events, the storage tier: PoolParts), then either a new host cache (once
the host budget made room: the host pool, its index and tier) or a live one it joins
(hicache.sidecar.shared_cache). On any failure, release what was made so far."""

from __future__ import annotations

import contextlib
import logging
import secrets
from dataclasses import dataclass

from hicache.api import EventPool
from hicache.keys import KEY_BYTES
from hicache.memory import CudaIpcOpens, FdStore
from hicache.memory.cuda_events import OpenedIpcEvents
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.sidecar.config import IO_BACKENDS, ServiceConfig
from hicache.sidecar.events import EventBus, PoolEvents
from hicache.sidecar.grants import window_pages
from hicache.sidecar.host_growth import first_pages
from hicache.sidecar.pool import RegisteredPool
from hicache.sidecar.registration import PoolIdentity, PoolRequest, map_device, map_engine_layout
from hicache.sidecar.shared_cache import CacheIdentity, SharedHostCache
from hicache.storage.base import StorageTier, TierIdentity
from hicache.storage.null import DownTier

log = logging.getLogger("hicache.sidecar.service")


@dataclass
class PoolParts:
    """What a registration makes before it takes any host memory: the engine's memory mapped,
    its offload events opened and the storage tier. The pool built from them owns them; until
    then, close() releases them."""

    device: DeviceKVPool | None  # None: the engine copies itself (memory kind "engine")
    offload_events: OpenedIpcEvents | None
    tier: StorageTier | None  # None: made for a pool expected to join a live host cache
    window: HostKVPool  # the copy window BeginCopy's offloads write (see sidecar.grants)

    def close(self) -> None:
        with contextlib.ExitStack() as undo:  # each one closed, even if another raises
            if self.device is not None:
                undo.callback(self.device.close)
            undo.callback(self.window.close)
            if self.offload_events is not None:
                undo.callback(self.offload_events.close)
            if self.tier is not None:
                undo.callback(self.tier.close)

    def take_tier(self) -> StorageTier:
        """The tier, which the caller owns from now on."""
        tier, self.tier = self.tier, None
        assert tier is not None
        return tier


def make_parts(
    req: PoolRequest, config: ServiceConfig, ipc: CudaIpcOpens, fds: FdStore, *, with_tier: bool = True
) -> PoolParts:
    """Map the memory `req` names, open its offload events and (with_tier) its storage tier.
    Raises ValueError for memory that cannot be mapped (and whatever the tier raises), with
    nothing left open."""
    with contextlib.ExitStack() as undo:
        device: DeviceKVPool | None = None
        engine_copies = req.device_memory.kind == "engine"
        if engine_copies:
            pass  # nothing to map: the engine copies, through its window and the host pool
        elif req.device_layout:
            device = map_engine_layout(
                req.geometry, req.device_pages, req.device_memory, req.device_layout, fds, ipc, req.cuda_device
            )
        else:
            device = map_device(req.geometry, req.device_pages, req.device_memory, req.cuda_device, ipc)
        if device is not None:
            undo.callback(device.close)
        pages = window_pages(req.geometry.page_bytes, req.device_pages, engine_copies=engine_copies)
        window = HostKVPool(req.geometry, pages, config.host_layout)  # what BeginCopy's offloads write
        undo.callback(window.close)
        offload_events = None
        if req.offload_events:
            offload_events = OpenedIpcEvents(req.offload_events, req.cuda_device, "offload_event_handles")
            undo.callback(offload_events.close)
        tier = make_tier(req, config) if with_tier else None
        undo.pop_all()
        return PoolParts(device, offload_events, tier, window)


def make_tier(req: PoolRequest, config: ServiceConfig) -> StorageTier:
    """The pool's storage tier; under an optional tier, one that cannot be made (OSError: a
    read-only or unusable folder; ImportError: a backend's package is missing) is a DownTier,
    reported down while host memory serves."""
    h = config.hierarchy
    try:
        return h.make_tier(req.geometry, req.stored_model_id, req.namespace)
    except (OSError, ImportError) as exc:
        if not config.storage_optional:
            raise
        reason = f"the {h.storage_backend} tier could not be made: {exc}"
        log.warning("pool of %s: %s; serving from host memory (--hicache-storage-optional)", req.model_id, reason)
        identity = TierIdentity.for_geometry(req.geometry, req.stored_model_id, req.namespace)
        return DownTier(identity, h.storage_backend, reason)


def build_pool(
    req: PoolRequest, parts: PoolParts, host_pages: int, config: ServiceConfig, bus: EventBus
) -> RegisteredPool:
    """The first pool of a new host cache: `req` over `parts`, with host_pages host pages, of
    which it uses the first ones only (host_growth.first_pages) until the service's HostGrower
    grows the cache to its host_goal; it owns the parts. Raises OSError when the host memory
    does not fit, with the host pool released and the parts (but the tier) still the caller's."""
    with contextlib.ExitStack() as undo:
        # None: made to join a live cache, which closed meanwhile
        tier = parts.take_tier() if parts.tier is not None else make_tier(req, config)
        undo.callback(tier.close)
        first = first_pages(host_pages, req.geometry.page_bytes)  # the rest in the background
        host = HostKVPool(req.geometry, host_pages, config.host_layout, committed_pages=first)
        undo.callback(host.close)
        cache = config.hierarchy.build(host, tier)
        undo.callback(cache.close)
        if host.committed_pages < host_pages:
            cache.resize_host(host.committed_pages)
        shared = SharedHostCache(CacheIdentity.of(req), cache, req.namespace)
        pool = join_pool(req, parts, shared, config, bus)
        undo.pop_all()
        return pool


def join_pool(
    req: PoolRequest, parts: PoolParts, shared: SharedHostCache, config: ServiceConfig, bus: EventBus
) -> RegisteredPool:
    """The pool `req` asks for over `parts`, a member of `shared`; it owns the parts (a tier
    among them, made for a cache it turned out to join, is closed). Raises StateError when
    `shared` is closing, with the parts still the caller's."""
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
        parts.device,
        shared,
        max_batch=config.max_batch,
        finished_ops_kept=config.finished_ops_kept,
        io_backend=IO_BACKENDS[config.io_backend],
        events=PoolEvents(
            bus, EventPool(identity.pool_id, req.namespace, req.model_id, req.group, req.tp_rank, req.tp_size)
        ),
        offload_events=parts.offload_events,
        layerwise_inline_bytes=config.layerwise_inline_bytes,
        device_pages=req.device_pages,
        grant_ttl_s=config.lease_timeout_s,
        window=parts.window,
        max_pin_share=config.max_pin_share,
    )
    if parts.tier is not None:
        with contextlib.suppress(Exception):
            parts.take_tier().close()
    return pool
