"""TransferEngine: page copies between a device pool and a host pool of one geometry."""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from hicache.pools.device import DeviceKVPool
from hicache.pools.host import HostKVPool
from hicache.transfer import native
from hicache.transfer.cpu import CpuCopier, full_views
from hicache.transfer.cpu_paths import CpuPaths, Pool
from hicache.transfer.cuda import CudaCopier, LayerHook, StreamHook
from hicache.transfer.handles import CpuTransferHandle, CudaTransferHandle, TransferHandle
from hicache.transfer.plan import PageList, TransferPlan, as_pages, make_plan
from hicache.transfer.progress import ProgressWords
from hicache.transfer.writers import WriterRegistry
from hicache.validate import is_int

if TYPE_CHECKING:
    from hicache.transfer._native import CopyQueue

Backend = Literal["auto", "native", "torch", "triton"]


log = logging.getLogger(__name__)
_engines: weakref.WeakSet[TransferEngine] = weakref.WeakSet()


def _forget_threads_after_fork() -> None:
    """In a forked child: no thread of an engine was copied, so each makes new ones on use."""
    for engine in list(_engines):
        engine._lock = threading.Lock()  # it may have been held by a thread of the parent
        engine._driver = engine._copier = engine._queue = None
        engine._writers.forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads_after_fork)


@functools.cache
def _warn_torch_fallback() -> None:
    log.warning(
        "hicache.transfer._native is not built (no C compiler at install time?): CPU copies use "
        "the slower torch path; reinstall with a C compiler (`pip install -e .`) to build it"
    )


class TransferEngine(CpuPaths):
    """Moves whole pages (every buffer of every, or the chosen, layers) between the pools.

    backend "auto": on CUDA, per transfer either cudaMemcpyAsync of large contiguous chunks
    or the Triton kernels, on dedicated write/load streams; on CPU, "native" when the C
    extension is built, else "torch". "native" (CPU pools only) copies a whole transfer's
    descriptor array in C; "torch" uses strided torch copies; both spread the work over
    `copy_threads` threads (default: torch's intra-op thread count). "triton" always uses
    the kernels (on a CPU pool only under TRITON_INTERPRET=1, for tests).

    offload/reload block until done; offload_async/reload_async return a TransferHandle
    with per-layer completion, and run one after another in the order they were started
    (on CPU, those below native.LAYERED_INLINE_BYTES are copied before they return). Only
    one transfer at a time may write a given page: a transfer whose destination pages
    overlap an unfinished one's raises ValueError.
    Call close() (or use `with`) to stop the engine's threads. A forked child's engine
    starts threads of its own on use. Transfers the parent left unfinished do not run in the
    child: their pages hold what was copied by the fork, and the child may write them again.

    The CPU copy paths are in cpu_paths.CpuPaths, which this class inherits.

    Raises ValueError if the pools' geometries differ, for an unknown backend, or for
    "native" on CUDA pools or without the built extension.
    """

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        backend: Backend = "auto",
        *,
        copy_threads: int | None = None,
    ):
        if device_pool.geometry != host_pool.geometry:
            diff = device_pool.geometry.diff(host_pool.geometry)
            raise ValueError(f"device and host pools have different geometries; fields differ: {diff}")
        if backend not in ("auto", "native", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'native', 'torch' or 'triton', got {backend!r}")
        on_cuda = bool(device_pool.flat.is_cuda)
        if backend == "native" and (on_cuda or not native.available()):
            why = "CUDA pools" if on_cuda else "this install: the C extension hicache.transfer._native is not built"
            raise ValueError(f"backend 'native' is not available for {why}")
        if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend 'triton' on a CPU pool needs TRITON_INTERPRET=1")
        if copy_threads is not None and (not is_int(copy_threads) or copy_threads < 1):
            raise ValueError(f"copy_threads must be an int >= 1 or None, got {copy_threads!r}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.geometry = device_pool.geometry
        self.backend: Backend = backend
        if backend == "auto":
            self.backend = "triton" if on_cuda else "native" if native.available() else "torch"
            if self.backend == "torch":
                _warn_torch_fallback()
        self._copy_threads = copy_threads
        self._cuda: CudaCopier | None = None
        if on_cuda and backend != "torch":
            self._cuda = CudaCopier(device_pool.flat.device, "auto" if backend == "auto" else "triton")
        self._views = {id(device_pool): full_views(device_pool), id(host_pool): full_views(host_pool)}
        self._writers = WriterRegistry()
        self._lock = threading.Lock()
        self._copier: CpuCopier | None = None
        self._driver: ThreadPoolExecutor | None = None  # asynchronous transfers of the torch backend
        self._queue: CopyQueue | None = None  # those of the native backend (a C thread)
        self._small: dict[tuple[bool, tuple[int, ...]], native.SmallCopy] = {}  # by (to host, layers)
        _engines.add(self)

    # ---- validation ------------------------------------------------------------------------
    def offload_plan(self, device_pages: PageList, host_pages: PageList) -> TransferPlan:
        """Validate an offload. Raises ValueError for out-of-range, duplicate or mismatched lists."""
        return make_plan(
            device_pages,
            self.device_pool.num_pages,
            host_pages,
            self.host_pool.num_pages,
            self.geometry.layer_num,
            None,
            ("device_pages", "host_pages"),
        )

    def reload_plan(
        self, host_pages: PageList, device_pages: PageList, layers: Sequence[int] | None = None
    ) -> TransferPlan:
        """Validate a reload; `layers` are pool-local layer indices. Raises ValueError."""
        return make_plan(
            host_pages,
            self.host_pool.num_pages,
            device_pages,
            self.device_pool.num_pages,
            self.geometry.layer_num,
            layers,
            ("host_pages", "device_pages"),
        )

    def check_device_pages(self, device_pages: PageList) -> None:
        """Raise ValueError (as reload would) if a device page is out of range, repeated, or
        the destination of an unfinished transfer. Changes nothing."""
        pages = as_pages("device_pages", device_pages, self.device_pool.num_pages)
        self._writers.check("device_pages", pages)

    # ---- blocking transfers ----------------------------------------------------------------
    def offload(self, device_pages: PageList, host_pages: PageList, *, ready: StreamHook | None = None) -> int:
        """Copy every layer of device_pages[i] into host_pages[i]. Returns bytes moved.

        ready (CUDA pools): called with the copy stream before the copy is queued, to make it
        wait for the work that writes the pages (another process's event)."""
        if ready is not None:
            self._check_cuda_hook("ready", ready)
        plan = self.offload_plan(device_pages, host_pages)
        with self._writers.claim("host_pages", plan.dst_pages):
            self._run(self.device_pool, self.host_pool, plan, load=False, before=ready)
        return plan.num_pages * self.geometry.page_bytes

    def reload(self, host_pages: PageList, device_pages: PageList, layers: Sequence[int] | None = None) -> int:
        """Copy host_pages[i] into device_pages[i], all layers or the given pool-local ones.
        Returns bytes moved."""
        plan = self.reload_plan(host_pages, device_pages, layers)
        with self._writers.claim("device_pages", plan.dst_pages):
            self._run(self.host_pool, self.device_pool, plan, load=True)
        return plan.num_pages * self.geometry.page_bytes_for(len(plan.layers))

    # ---- asynchronous transfers ------------------------------------------------------------
    def offload_async(self, device_pages: PageList, host_pages: PageList) -> TransferHandle:
        """Start an offload (as offload()); returns at once with a handle. Raises ValueError
        (nothing started) for bad lists or host pages an unfinished transfer is writing."""
        plan = self.offload_plan(device_pages, host_pages)
        nbytes = plan.num_pages * self.geometry.page_bytes
        return self._start(self.device_pool, self.host_pool, plan, nbytes, load=False)

    def reload_async(
        self,
        host_pages: PageList,
        device_pages: PageList,
        layers: Sequence[int] | None = None,
        *,
        progress: ProgressWords | None = None,
        after_layer: LayerHook | None = None,
    ) -> TransferHandle:
        """Start a reload (as reload()), layer by layer in ascending order; returns at once.

        handle.wait_layer(i) waits for pool-local layer i only, so a forward pass can use
        layer 0 while later layers still load. `progress`: words (zeroed here) the copy
        publishes its count of layers done into (a shared-memory block another process waits
        on); CPU pools only. `after_layer` (CUDA pools): called with (the layer's position, the copy
        stream) once each layer's copy is queued, to record another event there; all of them
        are called before this returns. Raises ValueError (nothing started) for bad lists or
        device pages an unfinished transfer is writing.
        """
        self._check_cuda_hook("after_layer", after_layer)
        plan = self.reload_plan(host_pages, device_pages, layers)
        nbytes = plan.num_pages * self.geometry.page_bytes_for(len(plan.layers))
        return self._start(
            self.host_pool, self.device_pool, plan, nbytes, load=True, progress=progress, after_layer=after_layer
        )

    def _check_cuda_hook(self, name: str, hook: object) -> None:
        if hook is not None and self._cuda is None:
            raise ValueError(f"{name} is for CUDA pools (stream hooks); this engine copies on {self.backend!r}")

    def _start(
        self,
        src: Pool,
        dst: Pool,
        plan: TransferPlan,
        nbytes: int,
        *,
        load: bool,
        progress: ProgressWords | None = None,
        after_layer: LayerHook | None = None,
    ) -> TransferHandle:
        pool = "device_pages" if load else "host_pages"
        pages = frozenset(plan.dst_pages.tolist())
        handle: TransferHandle
        with self._writers.reserve(pool, plan.dst_pages) as register:
            if self._cuda is not None:
                events = self._cuda.run(src, dst, plan, load=load, per_layer=True, sync=False, after_layer=after_layer)
                handle = CudaTransferHandle(plan.layers, nbytes, pool, pages, events)
            else:
                inline = self.backend == "native" and nbytes < native.LAYERED_INLINE_BYTES
                if progress is None and self.backend == "native" and not inline:
                    progress = ProgressWords.private(1)  # a queued copy's only news
                if progress is not None:
                    progress.reset()
                cpu_handle = CpuTransferHandle(plan.layers, nbytes, pool, pages, progress)
                if self.backend != "native":
                    self._driver_pool().submit(self._drive, src, dst, plan, cpu_handle)
                elif inline:
                    self._drive(src, dst, plan, cpu_handle)  # small: here, no hand-off to a thread
                else:
                    assert progress is not None
                    self._queue_all_layers(src, dst, plan, progress)
                handle = cpu_handle
            register(handle.done)
        return handle

    @property
    def cuda(self) -> CudaCopier | None:
        """The CUDA copier (its `paths` count), None for CPU pools or backend 'torch'."""
        return self._cuda

    # ---- execution -------------------------------------------------------------------------
    def _run(self, src: Pool, dst: Pool, plan: TransferPlan, *, load: bool, before: StreamHook | None = None) -> None:
        if plan.num_pages == 0 or not plan.layers:
            return
        if self._cuda is not None:
            self._cuda.run(src, dst, plan, load=load, per_layer=False, sync=True, before=before)
        else:
            self._copy_layers(src, dst, plan, None)

    def close(self) -> None:
        """Finish queued asynchronous transfers and stop the engine's threads. Idempotent."""
        with self._lock:
            driver, copier, queue = self._driver, self._copier, self._queue
            self._driver = self._copier = self._queue = None
        if driver is not None:
            driver.shutdown(wait=True)
        if queue is not None:
            queue.close()
        if copier is not None:
            copier.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
