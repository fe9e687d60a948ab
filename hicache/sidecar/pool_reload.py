"""The reload path of a registered pool: host pages copied into the engine's pages before the
answer, or layer-wise by a worker thread that publishes each layer to Watch, to a slot of
the progress block (CPU pools) or to a slot of CUDA layer events the engine's stream waits on."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicache.api import (
    KeyStatus,
    TransferResult,
)
from hicache.sidecar.operations import (
    Operation,
    copy_layers,
    reload_statuses,
)
from hicache.sidecar.pool_state import PoolState
from hicache.transfer.handles import TransferHandle
from hicache.transfer.progress import ProgressWords


class PoolReloads(PoolState):
    """Reload of RegisteredPool."""

    def reload(self, keys: Sequence[bytes], device_pages: Sequence[int], *, layerwise: bool) -> TransferResult:
        """Copy the longest loadable prefix of `keys` into device_pages: keys on host are
        LOADED, keys only in storage are fetched into host first (LOADED_FROM_STORAGE), and
        every key from the first one in no tier on is NOT_FOUND (with chained keys a page
        after a gap is of no use).

        Not layer-wise: copies before returning (done=True). Layer-wise: returns at once
        with an op id; a worker copies one layer at a time and publishes each to Watch.
        """
        ks = self.check_keys(keys, unique=True)
        pages = self.check_pages(device_pages, len(ks))
        with self._in_flight():  # first: close() may have released the device memory
            self.check_device()
            return self._reload(ks, pages, layerwise)

    def _reload(self, ks: list[bytes], pages: list[int], layerwise: bool) -> TransferResult:
        self._copier.check_device_pages(pages)  # before load() fetches or evicts anything
        loaded = self.cache.load(ks)
        op = Operation(self._ops.new_id(), self.geometry.layer_num)
        with self.lock:
            self._ops.add(op)
        n = len(loaded.keys)
        statuses = reload_statuses(loaded, len(ks))
        args = (op, loaded.keys, loaded.pages, pages[:n])
        nbytes = n * self.geometry.page_bytes
        if layerwise and self.progress is not None and nbytes < self.layerwise_inline_bytes:
            # as small as the engine copies in its calling thread: copied before the answer
            # (done), cheaper than a worker thread and the engine's layer waits
            layerwise = False
        if layerwise and self.progress is not None:
            return self._reload_layerwise(op, statuses, nbytes, args)
        if layerwise and self.layer_events is not None and n:
            return self._reload_with_events(op, statuses, nbytes, args)
        if not layerwise:
            try:
                self._copy_layers(*args, per_layer=False)
            except BaseException:
                self.cache.release(loaded.keys)
                raise
            self.cache.release(loaded.keys)
            return TransferResult(statuses, nbytes, op.op_id, True)
        return self._start_worker(op, statuses, nbytes, args, None)

    def _reload_layerwise(
        self, op: Operation, statuses: tuple[KeyStatus, ...], nbytes: int, args: tuple[Any, ...]
    ) -> TransferResult:
        """A layer-wise reload that also publishes into a progress-block slot (when one is
        free): the engine waits on the slot's words; Watch still has every event."""
        assert self.progress is not None
        progress = self.progress
        taken = progress.acquire()
        if taken is None:
            return self._start_worker(op, statuses, nbytes, args, None)
        slot, generation, words = taken
        _, keys, host_pages, dev_pages = args
        release = functools.partial(progress.release, slot)
        handle = self._start_copy(
            op, keys, lambda: self._copier.reload_async(host_pages, dev_pages, progress=words), release
        )  # started here, before the answer: no worker thread start ahead of the first layer
        result = self._start_worker(op, statuses, nbytes, args, release, handle, words=words)
        return dataclasses.replace(
            result, progress_slot=slot, progress_generation=generation, progress_words=len(words)
        )

    def _reload_with_events(
        self, op: Operation, statuses: tuple[KeyStatus, ...], nbytes: int, args: tuple[Any, ...]
    ) -> TransferResult:
        """A layer-wise reload on CUDA that records a slot of layer events (when one is free)
        before answering: the engine's stream waits for each layer on the GPU; a worker still
        follows the copy for Watch and frees the slot when it is done."""
        assert self.layer_events is not None
        events = self.layer_events
        slot = events.acquire()
        if slot is None:
            return self._start_worker(op, statuses, nbytes, args, None)
        _, keys, host_pages, dev_pages = args
        release = functools.partial(events.release, slot)
        handle = self._start_copy(
            op,
            keys,
            lambda: self._copier.reload_async(host_pages, dev_pages, after_layer=events.recorder(slot)),
            release,
        )
        result = self._start_worker(op, statuses, nbytes, args, release, handle)
        return dataclasses.replace(result, event_slot=slot, event_layers=self.geometry.layer_num)

    def _start_copy(
        self, op: Operation, keys: list[bytes], start: Callable[[], TransferHandle], release: Callable[[], None]
    ) -> TransferHandle:
        """start() a reload in the calling thread; if it raises, free its keys and its slot
        (`release`), mark the operation failed, and re-raise."""
        try:
            return start()
        except BaseException as exc:
            self.cache.release(keys)
            release()
            op.failed(f"{type(exc).__name__}: {exc}", 0)
            raise

    def _start_worker(
        self,
        op: Operation,
        statuses: tuple[KeyStatus, ...],
        nbytes: int,
        args: tuple[Any, ...],
        release: Callable[[], None] | None,
        started: TransferHandle | None = None,
        words: ProgressWords | None = None,
    ) -> TransferResult:
        """Run _reload_worker in a thread of its own (`release` frees its slot when it ends);
        answer with the op to Watch."""
        kwargs = {"release": release, "started": started, "words": words}
        worker = threading.Thread(target=self._reload_worker, args=args, kwargs=kwargs, daemon=True)
        with self.lock:
            self._busy += 1  # the worker's own count, dropped when it ends
        try:
            worker.start()
        except BaseException as exc:
            if started is not None:  # the copy is queued: its host pages stay held until it ends
                with contextlib.suppress(Exception):
                    started.wait()
            self.cache.release(args[1])
            self._done_one()
            if release is not None:
                release()
            op.failed(f"{type(exc).__name__}: {exc}", 0)
            raise
        return TransferResult(statuses, nbytes, op.op_id, False)

    def _reload_worker(
        self,
        op: Operation,
        keys: list[bytes],
        host_pages: list[int],
        dev_pages: list[int],
        *,
        release: Callable[[], None] | None = None,
        started: TransferHandle | None = None,
        words: ProgressWords | None = None,
    ) -> None:
        try:
            self._copy_layers(op, keys, host_pages, dev_pages, per_layer=True, progress=words, started=started)
        except Exception:
            pass  # already published to the operation as FAILED
        finally:
            self.cache.release(keys)
            if release is not None:
                release()
            self._done_one()

    def _copy_layers(
        self,
        op: Operation,
        keys: list[bytes],
        host_pages: list[int],
        dev_pages: list[int],
        *,
        per_layer: bool,
        progress: ProgressWords | None = None,
        started: TransferHandle | None = None,
    ) -> None:
        """Copy (one layer at a time when per_layer, publishing each), count, publish DONE or
        FAILED."""
        t0 = time.perf_counter()
        nbytes = copy_layers(
            self._copier, op, host_pages, dev_pages, per_layer=per_layer, progress=progress, started=started
        )
        with self.lock:
            self.counters.reload_bytes += nbytes
            self.counters.reload_s += time.perf_counter() - t0 if host_pages else 0.0
        op.done()
