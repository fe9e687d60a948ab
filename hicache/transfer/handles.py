"""Handles of asynchronous transfers, with per-layer completion.

A transfer copies its layers in order (plan.layers, ascending pool-local indices), so
"layer i is ready" means every earlier layer of the transfer is ready too.

- `CpuTransferHandle`: filled in by the engine's transfer thread, which publishes each
  layer as its copies finish. wait_layer blocks the calling thread. With progress words
  (the native path), the C copy publishes each layer itself and wait and wait_layer wait
  on the words' futexes without the GIL; a copy on the C queue tells nothing else.
- `CudaTransferHandle`: one CUDA event per layer, recorded on the engine's load (or
  write) stream. wait_layer makes the caller's current CUDA stream wait for the event,
  so kernels queued afterwards see the layer, without blocking the host.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from hicache.transfer.progress import FAILED, ProgressWords


class TransferHandle:
    """An in-flight transfer of `nbytes` bytes over pool-local `layers` into `dst_pages`.

    wait() returns nbytes once every layer is copied, or raises what the copy raised.
    """

    def __init__(self, layers: tuple[int, ...], nbytes: int, pool: str, dst_pages: frozenset[int]):
        self.layers = layers
        self.nbytes = nbytes
        self.pool = pool  # "device" or "host": which pool dst_pages belong to
        self.dst_pages = dst_pages

    def done(self) -> bool:
        """Whether the transfer has finished (copied every layer, or failed)."""
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        """Block until the transfer finishes; return bytes moved.

        Raises the copy's exception, or TimeoutError after `timeout` seconds.
        """
        raise NotImplementedError

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Wait until pool-local `layer` is copied. Raises ValueError if the transfer does not
        carry that layer, the copy's exception if it failed, TimeoutError after `timeout`."""
        raise NotImplementedError

    def wait_layer_host(self, layer: int, timeout: float | None = None) -> None:
        """Like wait_layer, but always blocks the calling thread until the layer's bytes are
        in place (what a process that announces the layer to another one needs)."""
        self.wait_layer(layer, timeout)

    def _position(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise ValueError(f"layer {layer!r} is not part of this transfer (layers {list(self.layers)})") from None


class CpuTransferHandle(TransferHandle):
    """A transfer run by a CPU thread that publishes per-layer progress (into `words` too,
    when given: see hicache.transfer.progress)."""

    def __init__(
        self,
        layers: tuple[int, ...],
        nbytes: int,
        pool: str,
        dst_pages: frozenset[int],
        words: ProgressWords | None = None,
    ):
        super().__init__(layers, nbytes, pool, dst_pages)
        self._cond = threading.Condition()
        self._ready = 0  # layers[:_ready] are copied (without words)
        self._finished = False
        self._error: BaseException | None = None
        self.words = words

    @property
    def layers_ready(self) -> int:
        """How many of `layers` (a prefix, in order) are copied so far."""
        if self.words is not None:
            done = self.words.done()
            return len(self.layers) if done == FAILED else min(done, len(self.layers))
        with self._cond:
            return self._ready

    def done(self) -> bool:
        """True once every layer is in place (or the copy failed), as the progress words or
        the published layers say: the copy thread may not have called finish() yet, but it
        writes no page any more (so another transfer may write them: the single-writer rule;
        a process that waited on the words must not be refused the same pages right after)."""
        if self._finished:
            return True
        if self.words is not None:
            done = self.words.done()
            return done == FAILED or done >= len(self.layers)
        with self._cond:
            return self._finished or self._ready >= len(self.layers)

    def wait(self, timeout: float | None = None) -> int:
        if self._finished and self._error is None:  # set once, never cleared: no lock needed
            return self.nbytes
        if self.words is not None and self.layers:  # a queued C copy publishes only there
            if not self.words.wait(len(self.layers), timeout):
                raise TimeoutError(
                    f"transfer not finished after {timeout} s ({self.layers_ready}/{len(self.layers)} layers)"
                )
            if self.words.done() != FAILED:
                return self.nbytes
            # FAILED: finish() is on its way with the error
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished, timeout):
                raise TimeoutError(f"transfer not finished after {timeout} s ({self._ready}/{len(self.layers)} layers)")
            if self._error is not None:
                raise self._error
        return self.nbytes

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        need = self._position(layer) + 1
        if self._finished and self._error is None:  # e.g. a small reload copied before it returned
            return
        if self.words is not None:
            if not self.words.wait(need, timeout):
                raise TimeoutError(f"layer {layer} not copied after {timeout} s")
            if self.words.done() != FAILED:
                return
            self.wait(timeout)  # raises the copy's error
            return
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready >= need or self._finished, timeout):
                raise TimeoutError(f"layer {layer} not copied after {timeout} s")
            if self._ready < need:
                assert self._error is not None, "a finished transfer is complete or failed"
                raise self._error

    # ---- called by the transfer thread ---------------------------------------------------
    def publish_layer(self) -> None:
        with self._cond:
            assert self._ready < len(self.layers)
            self._ready += 1
            self._cond.notify_all()
        if self.words is not None:
            self.words.publish_all(self._ready)

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._error = error
            self._finished = True
            if error is None:  # a copy that published nothing here (a native one) is whole too
                self._ready = len(self.layers)
            self._cond.notify_all()
        # (a native copy has published every layer into its words already: no second wake-up)
        if self.words is not None and (error is not None or self.words.done() != len(self.layers)):
            self.words.publish_all(FAILED if error is not None else len(self.layers))


class CudaTransferHandle(TransferHandle):
    """A transfer queued on a CUDA stream, with one event recorded after each layer."""

    def __init__(self, layers: tuple[int, ...], nbytes: int, pool: str, dst_pages: frozenset[int], events: list[Any]):
        super().__init__(layers, nbytes, pool, dst_pages)
        assert len(events) == len(layers)
        self.events = events  # torch.cuda.Event, one per layer

    def done(self) -> bool:
        return all(bool(e.query()) for e in self.events)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is not None and self.events and not _poll(self.events[-1], timeout):  # the stream's last
            raise TimeoutError(f"transfer not finished after {timeout} s")
        for event in self.events:
            event.synchronize()
        return self.nbytes

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        import torch

        event = self.events[self._position(layer)]
        torch.cuda.current_stream().wait_event(event)

    def wait_layer_host(self, layer: int, timeout: float | None = None) -> None:
        event = self.events[self._position(layer)]
        if timeout is not None and not _poll(event, timeout):
            raise TimeoutError(f"layer {layer} not copied after {timeout} s")
        event.synchronize()


def _poll(event: Any, timeout: float) -> bool:
    """Whether the event completes within `timeout` s, asked at growing intervals (50 µs
    to 1 ms): a CUDA event has no wait with a limit."""
    deadline = time.monotonic() + timeout
    pause = 50e-6
    while not event.query():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 1e-3)
    return True
