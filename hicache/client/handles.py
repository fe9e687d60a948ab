"""What the client hands back besides plain results: errors and reload handles."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from hicache.api import OpEvent, TransferResult
from hicache.rpc import convert
from hicache.transfer.progress import FAILED, ProgressWords
from hicache.validate import is_int


class HiCacheRpcError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the sidecar's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class ReloadOutcomeUnknown(RuntimeError):
    """The sidecar no longer knows a reload (it pruned the finished operation after its
    progress slot was reused, or it restarted) and the handle never saw the reload end: its
    pages may or may not be in place."""


PROBE_S = 1.0  # a wait in the progress slot asks this often whether the sidecar is still there
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)  # probe answers: sidecar gone, pool forgotten
# A Watch the sidecar refuses (RESOURCE_EXHAUSTED: its streams hold every slot they may) is
# asked again after a pause that doubles from the first value up to the second
REFUSED_PAUSE_S, REFUSED_PAUSE_MAX_S = 0.01, 0.5


class ProgressSlot:
    """A reload's slot in the pool's progress block, mapped in this process: its progress
    words, valid while the slot's word 0 still holds `generation`."""

    def __init__(self, row: np.ndarray, generation: int, words: int):
        self.row, self.generation = row, generation
        self.words = ProgressWords(row[1 : 1 + words])

    def current(self) -> bool:
        return int(self.row[0]) == self.generation


class ReloadHandle:
    """A reload in progress. statuses[i] is LOADED, LOADED_FROM_STORAGE (fetched from the
    storage tier first) or NOT_FOUND for keys[i]; the loaded keys are a prefix of keys.

    wait_layer(i) returns once pool-local layer i (0 .. layer_num-1) of every loaded page
    is on the device. A layer-wise reload with a progress slot (a sidecar on this host with
    the native copy path) is waited on in that shared memory, on a futex, without a message
    per layer; otherwise, or once the slot says the reload failed (or was reused), the
    handle follows the sidecar's Watch stream in a thread (asked again while the sidecar
    refuses it for want of a stream slot). On a CUDA pool with layer events
    (`stream_wait`), wait_layer(i) makes the caller's current CUDA stream wait for layer i
    on the GPU and returns at once; a failure then surfaces from wait().

    While a wait sits in the progress slot, `probe` (if given) is called about once a second
    and raises HiCacheRpcError when the sidecar is gone (UNAVAILABLE) or forgot the pool
    (NOT_FOUND): a killed sidecar never moves the slot's words, so the wait raises that error
    instead of blocking. What the slot said while it was the reload's is remembered, so a
    reload seen done stays done after the slot is reused.
    """

    def __init__(
        self,
        result: TransferResult,
        layer_num: int,
        watch: Callable[[], Any] | None,
        slot: ProgressSlot | None = None,
        stream_wait: Callable[[int], None] | None = None,
        probe: Callable[[], None] | None = None,
    ):
        self.statuses = result.statuses
        self.op_id = result.op_id
        self.bytes_copied = result.bytes_copied
        self.layer_num = layer_num
        self._cond = threading.Condition()
        self._layers_done = layer_num if result.done else 0
        self._finished = result.done
        self._error: str | None = None
        self._unknown = False  # _error says the sidecar forgot the reload, not that it failed
        self._lost: HiCacheRpcError | None = None  # the probe found the sidecar gone
        self._probe = probe
        self._watch = watch
        self._watching = False
        self._slot = None if result.done else slot
        self._stream_wait = None if result.done else stream_wait
        if not result.done and slot is None:
            self._follow_watch()

    def _follow_watch(self) -> None:
        with self._cond:
            if self._watching:
                return
            self._watching = True
        assert self._watch is not None
        threading.Thread(target=self._follow, args=(self._watch,), daemon=True, name="hicache-watch").start()

    def _slot_wait(self, target: int, timeout: float | None) -> bool:
        """Wait in the progress slot until `target` layers are done: True when they are (or
        were seen done before); False when the slot cannot tell (failed, reused): then Watch
        must. Raises TimeoutError, or HiCacheRpcError when the sidecar is found gone."""
        if self._layers_done >= target and self._error is None:
            return True  # seen done before: the slot may have been reused since
        if self._lost is not None:
            raise self._lost
        slot = self._slot
        if slot is None or self._watching or not slot.current():
            return False
        if not slot.words.wait(target, timeout, self._still_ours(slot)):
            if not slot.current():
                return False
            raise TimeoutError(f"reload {self.op_id}: {target} layers not done after {timeout} s")
        seen = self._read_slot(slot)
        return seen is not None and seen >= target

    def _read_slot(self, slot: ProgressSlot) -> int | None:
        """The layers the slot says are done, remembered (the slot may be reused later);
        None when it cannot tell (the reload failed, or the slot is another reload's now)."""
        done = slot.words.done()
        if done == FAILED or not slot.current():  # words read first: still ours after, they were ours
            return None
        with self._cond:
            self._layers_done = max(self._layers_done, min(done, self.layer_num))
            self._finished = self._finished or self._layers_done >= self.layer_num
            self._cond.notify_all()
        return done

    def _still_ours(self, slot: ProgressSlot) -> Callable[[], bool]:
        """The slot wait's `valid`: False once the slot is reused; about every PROBE_S s it
        also probes the sidecar, so that a dead one raises instead of blocking forever."""
        next_probe = time.monotonic() + PROBE_S

        def valid() -> bool:
            nonlocal next_probe
            if not slot.current():
                return False
            if self._probe is not None and time.monotonic() >= next_probe:
                self._check_sidecar()
                next_probe = time.monotonic() + PROBE_S
            return True

        return valid

    def _check_sidecar(self) -> None:
        """Probe the sidecar; raises HiCacheRpcError (remembered: later waits raise it too)
        when it is gone or forgot the pool. Other errors (a slow answer) prove nothing."""
        assert self._probe is not None
        try:
            self._probe()
        except HiCacheRpcError as exc:
            if exc.code not in LOST:
                return
            lost = HiCacheRpcError(exc.code, f"reload {self.op_id} not done and the sidecar is lost: {exc.details}")
            with self._cond:
                self._lost, self._finished = lost, True
                self._cond.notify_all()
            raise lost from None

    def _follow(self, watch: Callable[[], Any]) -> None:
        pause = REFUSED_PAUSE_S
        while True:
            try:
                for msg in watch():
                    self._on_event(convert.event_from_pb(msg))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    if self._finished:  # seen done meanwhile (the progress slot): nothing to learn
                        break
                    time.sleep(pause)  # every stream slot of the sidecar is held: the reload goes on
                    pause = min(2 * pause, REFUSED_PAUSE_MAX_S)
                    continue
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._probe is not None and not self._finished:
                    # the stream's deadline passed, not the reload's: a copy still running must
                    # not be reported failed (its pages could be reused under it); ask again
                    # while the sidecar answers a probe (one that is gone marks the handle lost)
                    try:
                        self._check_sidecar()
                    except HiCacheRpcError:
                        break
                    continue
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self._forgotten(f"{exc.code().name}: {exc.details()}")
                else:
                    self._on_event(OpEvent("failed", error=f"{exc.code().name}: {exc.details()}"))
            except Exception as exc:  # e.g. the client's channel closed: waits must not hang
                self._on_event(OpEvent("failed", error=f"following the reload failed: {exc!r}"))
            break
        with self._cond:
            if not self._finished:
                self._finished, self._error = True, self._error or "watch stream ended early"
            self._cond.notify_all()

    def _on_event(self, event: OpEvent) -> None:
        with self._cond:
            if event.kind == "layer_done":
                self._layers_done = max(self._layers_done, event.layers_done)
                self._finished = self._finished or self._layers_done >= self.layer_num
            elif event.kind == "done":
                self._layers_done, self._finished = self.layer_num, True
            else:
                self._finished, self._error = True, event.error or "reload failed"
            self._cond.notify_all()

    def _forgotten(self, error: str) -> None:
        """Watch answered NOT_FOUND: the sidecar no longer knows the reload. Done if every
        layer was seen done in the slot; otherwise its outcome is unknown, not a failure."""
        with self._cond:
            if self._layers_done < self.layer_num:
                self._error, self._unknown = error, True
            self._finished = True
            self._cond.notify_all()

    @property
    def gpu_waits(self) -> bool:
        """Whether wait_layer orders the CUDA stream after the layer (layer events) instead
        of blocking the host."""
        return self._stream_wait is not None

    def done(self) -> bool:
        """Whether the reload has ended (every layer in place, or failed). A reload seen done
        answers at once: no lock, no wait (set once, never cleared)."""
        if self._finished:
            return True
        slot = self._slot
        if slot is not None and not self._watching:
            if self._read_slot(slot) is not None:
                return self._finished
            self._follow_watch()  # failed, or the slot was reused: Watch says how it ended
        with self._cond:
            return self._finished

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until `layer` is reloaded (CUDA layer events: order the current stream after
        it, without blocking). Raises ValueError for a bad layer, RuntimeError if the reload
        failed (ReloadOutcomeUnknown, a RuntimeError, if the sidecar forgot it before it was
        seen done), TimeoutError after `timeout` s, HiCacheRpcError if the sidecar is lost
        while the wait sits in the progress slot (see the class)."""
        if not is_int(layer) or not 0 <= layer < self.layer_num:
            raise ValueError(f"layer {layer!r} out of range [0, {self.layer_num})")
        if self._stream_wait is not None:
            self._stream_wait(layer)  # the GPU waits; the host goes on
            return
        if self._slot_wait(layer + 1, timeout):
            return
        self._follow_watch()
        self._wait(lambda: self._layers_done > layer, timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every layer is reloaded (same errors as wait_layer)."""
        if self._slot_wait(self.layer_num, timeout):
            return
        if not self._finished:
            self._follow_watch()
        self._wait(lambda: self._layers_done >= self.layer_num, timeout)

    def _wait(self, ready: Callable[[], bool], timeout: float | None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: ready() or self._error is not None, timeout):
                raise TimeoutError(f"reload {self.op_id} not done after {timeout} s")
            if self._error is None or (self._unknown and ready()):
                return  # a layer seen done stays done, though the sidecar forgot the reload since
            if self._unknown:
                raise ReloadOutcomeUnknown(
                    f"reload {self.op_id}: outcome unknown, the sidecar no longer knows it ({self._error});"
                    f" {self._layers_done} of {self.layer_num} layers were seen done"
                )
            raise RuntimeError(f"reload {self.op_id} failed: {self._error}")
