"""CpuPaths: how TransferEngine copies on CPU pools, by backend.

"native": one C call per transfer from a page template (SmallCopy) below
native.SMALL_BYTES, else a descriptor array; an asynchronous one of at least
native.LAYERED_INLINE_BYTES goes to the C copy queue. "torch": strided torch copies, spread
over the copy threads (CpuCopier) from cpu.INLINE_BYTES on. "triton": the kernels (under
TRITON_INTERPRET=1 on CPU). TransferEngine inherits these methods; tests replace
_copy_layers and _copy_all_layers on an engine, so the paths call them through self.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from hicache.geometry import KVGeometry
from hicache.pools.device import DeviceKVPool
from hicache.pools.host import HostKVPool
from hicache.transfer import native
from hicache.transfer.cpu import INLINE_BYTES, CpuCopier, copy_views
from hicache.transfer.cuda import layer_plan
from hicache.transfer.handles import CpuTransferHandle
from hicache.transfer.plan import TransferPlan
from hicache.transfer.progress import ProgressWords

if TYPE_CHECKING:
    from hicache.transfer._native import CopyQueue

MAX_THREADS = 64  # the most threads one C copy call runs (copy_pieces)
Pool = DeviceKVPool | HostKVPool


class CpuPaths:
    """The CPU copy paths of TransferEngine, which sets these attributes."""

    backend: str
    geometry: KVGeometry
    device_pool: DeviceKVPool
    _copy_threads: int | None
    _views: dict[int, Any]
    _lock: threading.Lock
    _copier: CpuCopier | None
    _driver: ThreadPoolExecutor | None
    _queue: CopyQueue | None
    _small: dict[tuple[bool, tuple[int, ...]], native.SmallCopy]

    @property
    def threads(self) -> int:
        """Threads that copy a large CPU transfer (the calling one and the copy crew's)."""
        return min(MAX_THREADS, self._copy_threads or torch.get_num_threads())

    def _threads_for(self, nbytes: int) -> int:
        """Threads that copy a native transfer of `nbytes`: all of them from
        native.SHARE_MIN_BYTES on, else 1 (this thread only)."""
        return self.threads if nbytes >= native.SHARE_MIN_BYTES else 1

    def _drive(self, src: Pool, dst: Pool, plan: TransferPlan, handle: CpuTransferHandle) -> None:
        try:
            if self.backend == "native":
                self._copy_all_layers(src, dst, plan, handle.words)
            else:
                for layer in plan.layers:
                    self._copy_layers(src, dst, plan, (layer,))
                    handle.publish_layer()
        except BaseException as exc:  # surfaces from handle.wait()
            handle.finish(exc)
        else:
            handle.finish()

    def _copy_all_layers(self, src: Pool, dst: Pool, plan: TransferPlan, words: ProgressWords | None) -> None:
        """Every layer of a transfer below native.LAYERED_INLINE_BYTES in one C call from this
        thread (and the copy crew's), publishing the count of layers done into the first word
        (the others are done from the start), if any. No descriptors are built in Python."""
        if not plan.layers:
            return
        nbytes = plan.num_pages * self.geometry.page_bytes_for(len(plan.layers))
        address = 0
        if words is not None:
            self._publish_spares(words, len(plan.layers))
            address = words.addresses[0]
        self._small_copy(src, dst, plan.layers)(plan.src_pages, plan.dst_pages, address, self._threads_for(nbytes))

    def _queue_all_layers(self, src: Pool, dst: Pool, plan: TransferPlan, words: ProgressWords) -> None:
        """Plan every layer here (the GIL is held anyway) and queue the copy on the C queue,
        whose thread starts it without the GIL (with the copy crew): the count of layers done
        it publishes into the first word is the handle's only news of the copy."""
        batch = native.layered(src, dst, plan, plan.layers)
        self._publish_spares(words, len(plan.layers))
        with self._lock:
            if self._queue is None:
                self._queue = native.copy_queue()
            queue = self._queue
        threads = self._threads_for(batch.nbytes)
        native.layered_submit(queue, src, dst, batch, threads, words.addresses[0], (src, dst, words))

    @staticmethod
    def _publish_spares(words: ProgressWords, layers: int) -> None:
        for spare in range(1, len(words)):  # the copy publishes into the first word only
            words.publish(spare, layers)

    def _copy_layers(self, src: Pool, dst: Pool, plan: TransferPlan, layers: tuple[int, ...] | None) -> None:
        """Copy `layers` (all of plan's when None) of the plan in this thread's turn."""
        if self.backend == "triton":
            from hicache.transfer.triton_kernels import copy_pages_triton

            copy_pages_triton(src, dst, plan if layers is None else layer_plan(plan, layers))
            return
        if self.backend == "native":
            chosen = plan.layers if layers is None else layers
            nbytes = plan.num_pages * self.geometry.page_bytes_for(len(chosen))
            if nbytes < native.SMALL_BYTES:  # no descriptors in Python
                self._small_copy(src, dst, chosen)(plan.src_pages, plan.dst_pages, 0, self._threads_for(nbytes))
                return
            batch = native.descriptors(src, dst, plan, chosen)
            native.batch_call(src, dst, batch, self._threads_for(batch.nbytes))()
            return
        runs = None if layers is None else [(layer, 1) for layer in layers]
        dsts, srcs = copy_views(self._views[id(src)], self._views[id(dst)], plan, runs)
        copier = self._cpu_copier(sum(d.numel() for d in dsts))
        if copier is not None:
            copier.run(dsts, srcs)
        elif dsts:
            torch._foreach_copy_(dsts, srcs)

    def _small_copy(self, src: Pool, dst: Pool, layers: tuple[int, ...]) -> native.SmallCopy:
        """The native copy of a small transfer of `layers` between the pools, made once."""
        key = (src is self.device_pool, layers)
        copy = self._small.get(key)
        if copy is None:
            if len(self._small) >= 64:  # layer-wise reloads of many layer sets: keep it bounded
                self._small.clear()
            copy = self._small[key] = native.small_copy(src, dst, layers)
        return copy

    def _cpu_copier(self, nbytes: int) -> CpuCopier | None:
        """The copy threads, started by the first transfer big enough to use them."""
        with self._lock:
            if self._copier is None and nbytes >= INLINE_BYTES:
                self._copier = CpuCopier(self._copy_threads)
            return self._copier

    def _driver_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._driver is None:
                self._driver = ThreadPoolExecutor(1, thread_name_prefix="hicache-transfer")
            return self._driver
