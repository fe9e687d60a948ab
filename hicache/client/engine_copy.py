"""Copy path "engine": the engine copies between its own KV memory and the sidecar's host pool.

Where the sidecar cannot map the engine's memory (vLLM's CPU worker allocates its KV cache
with torch.zeros, a private allocation; a CUDA pool in a CuMem pool cannot be exported over
CUDA IPC; SGLang's host pool outside memfds, its K and V in two allocations), the engine maps the sidecar's host pool (shared memory; page-locked here when the
engine's memory is on CUDA) and runs a TransferEngine, with the same KVGeometry, between
the two. The host pool is mapped for reading only: an offload is written into the pool's
copy window (a segment of its own, mapped read-write), which the sidecar copies into the
host pages at EndCopy. The sidecar keeps the index, eviction, tiers and pins: BeginCopy
grants pages, EndCopy publishes an offload's pages (only then can any lookup see them) or
drops a reload's hold. A reload whose EndCopy fails reports its pages as not loaded: the
sidecar no longer vouched for them. See hicache.sidecar.grants.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from hicache.api import CopyGrant, KeyStatus, TransferResult
from hicache.geometry import KVGeometry
from hicache.memory import MemoryHandle, SharedBuffer, SpanBuffer, pin_host
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.pools.layouts import check_segments, engine_layout
from hicache.pools.mapped import MappedKVPool
from hicache.transfer import TransferEngine

log = logging.getLogger("hicache.client")

BeginCopy = Callable[[Sequence[bytes], bool], CopyGrant]  # (keys, offload) -> grant
EndCopy = Callable[[str, bool, float], int]  # (grant id, commit, copy seconds) -> pages


def local_pool(geometry: KVGeometry, num_pages: int, memory: SharedBuffer, device_layout: str = "") -> DeviceKVPool:
    """The engine's own memory as a pool: hicache's layer_first (device_layout ""), or the
    engine's layout (an EngineLayout or BlockLayout name: vLLM's blocks, SGLang's pools).
    Memory of several allocations (a SpanBuffer: SGLang's K and V host buffers) holds one
    buffer of the layout per segment, each region within its segment. Raises ValueError for
    memory too small for num_pages pages of that layout, or segments that do not match it."""
    segments = memory.segments if isinstance(memory, SpanBuffer) else None
    if not device_layout:
        if segments is not None and len(segments) > 1:
            raise ValueError(f"hicache's own layout takes one allocation, got {len(segments)} segments")
        return DeviceKVPool(geometry, num_pages, memory=memory)
    if segments is None:
        layout = engine_layout(geometry, num_pages, device_layout, None, memory.nbytes)
        return MappedKVPool(geometry, layout, memory)
    if len(segments) not in (1, len(geometry.buffers)):
        names = [b.name for b in geometry.buffers]
        raise ValueError(f"{len(segments)} memory segments for the buffers {names}: give one, or one per buffer")
    bases = tuple(offset for offset, _ in segments) if len(segments) > 1 else None
    layout = engine_layout(geometry, num_pages, device_layout, bases, memory.nbytes)
    named = [(f"memory segment {i}", at, n) for i, (at, n) in enumerate(segments)]
    check_segments(layout, sorted(named, key=lambda seg: seg[1]))
    return MappedKVPool(geometry, layout, memory)


class EngineCopy:
    """One pool's copies in the engine's process: its memory, the host pool mapped for
    reading and the copy window mapped for writing."""

    def __init__(self, device: DeviceKVPool, host: HostKVPool, window: HostKVPool, begin: BeginCopy, end: EndCopy):
        self.device, self.host, self.window = device, host, window
        self.engine = TransferEngine(device, host)  # reloads: host -> device
        self.writer = TransferEngine(device, window)  # offloads: device -> window
        self._begin, self._end = begin, end
        self._window_lock = threading.Lock()  # one offload in the window at a time

    @classmethod
    def attach(
        cls,
        device: DeviceKVPool,
        host_name: str,
        host_pages: int,
        host_layout: str,
        window_name: str,
        window_pages: int,
        begin: BeginCopy,
        end: EndCopy,
    ) -> EngineCopy:
        """Map the sidecar's host pool `host_name` (host_pages pages in host_layout) for
        reading and its copy window `window_name` (window_pages pages, same layout) beside
        `device`; page-locked when `device` is on CUDA. Raises ValueError or OSError."""
        if not window_name or window_pages < 1:
            raise ValueError(f"the sidecar gave no copy window for this pool (got {window_name!r}, {window_pages})")
        g = device.geometry
        with contextlib.ExitStack() as undo:
            host = HostKVPool.attach(g, host_pages, host_layout, MemoryHandle("shm", 0, name=host_name), read_only=True)
            undo.callback(host.close)
            window = HostKVPool.attach(g, window_pages, host_layout, MemoryHandle("shm", 0, name=window_name))
            undo.callback(window.close)
            if device.flat.is_cuda and not (pin_host(host.memory, read_only=True) and pin_host(window.memory)):
                log.warning("the sidecar's host pool is not page-locked in this process: copies run pageable")
            copier = cls(device, host, window, begin, end)
            undo.pop_all()
            return copier

    def offload(self, keys: Sequence[bytes], device_pages: Sequence[int]) -> TransferResult:
        """Copy device_pages[i] into the window page granted to keys[i], then have the
        sidecar publish them: STORED, DEDUPLICATED or NO_SPACE each. An offload larger than
        the window goes in window-sized parts, each granted and published on its own. A
        failed copy publishes nothing of its part (and raises)."""
        pages = self._checked(keys, device_pages)
        statuses: list[KeyStatus] = []
        nbytes = 0
        step = self.window.num_pages
        with self._window_lock:
            for at in range(0, len(pages), step):
                part = self._offload_part(keys[at : at + step], pages[at : at + step])
                statuses += part.statuses
                nbytes += part.bytes_copied
        return TransferResult(tuple(statuses), nbytes)

    def _offload_part(self, keys: Sequence[bytes], pages: list[int]) -> TransferResult:
        grant = self._begin(keys, True)
        src = [p for p, s in zip(pages, grant.statuses, strict=True) if s == KeyStatus.STORED]
        if not grant.grant_id:
            return TransferResult(grant.statuses, 0)
        t0 = time.perf_counter()
        try:
            nbytes = self.writer.offload(src, list(grant.host_pages))
        except BaseException:
            self._abandon(grant.grant_id)
            raise
        self._end(grant.grant_id, True, time.perf_counter() - t0)
        return TransferResult(grant.statuses, nbytes)

    def reload(self, keys: Sequence[bytes], device_pages: Sequence[int]) -> TransferResult:
        """Copy the longest loadable prefix of `keys` into device_pages (done when this
        returns): LOADED / LOADED_FROM_STORAGE, then NOT_FOUND, device pages untouched. If the
        sidecar cannot end the grant afterwards (it ended with the pool, the sidecar is gone),
        the copied pages may have been reused meanwhile: all are NOT_FOUND, and their device
        pages hold bytes to be recomputed."""
        pages = self._checked(keys, device_pages)
        grant = self._begin(keys, False)
        if not grant.grant_id:
            return TransferResult(grant.statuses, 0)
        n = len(grant.host_pages)
        t0 = time.perf_counter()
        try:
            nbytes = self.engine.reload(list(grant.host_pages), pages[:n])
        except BaseException:
            self._abandon(grant.grant_id)
            raise
        try:
            self._end(grant.grant_id, True, time.perf_counter() - t0)
        except Exception as exc:
            log.warning("reload copied %d pages, but ending its grant failed (reported not loaded): %s", n, exc)
            return TransferResult((KeyStatus.NOT_FOUND,) * len(keys), 0)
        return TransferResult(grant.statuses, nbytes)

    def _checked(self, keys: Sequence[bytes], device_pages: Sequence[int]) -> list[int]:
        """Raises ValueError, before anything is granted, for pages that do not match keys."""
        pages = list(device_pages)
        if len(pages) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(pages)} device pages")
        self.engine.check_device_pages(pages)
        return [int(p) for p in pages]

    def _abandon(self, grant_id: str) -> None:
        try:
            self._end(grant_id, False, 0.0)
        except Exception as exc:  # the grant ends with its time or the pool's lease
            log.warning("could not end copy grant %s after a failed copy: %s", grant_id, exc)

    def close(self) -> None:
        """Unmap the host pool and the window (the engine's memory stays the engine's)."""
        with contextlib.ExitStack() as steps:
            for part in (self.host, self.window, self.writer, self.engine):
                steps.callback(part.close)
