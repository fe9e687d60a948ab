"""What the client hands back besides plain results: errors and reload handles."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc

from hicache.api import OpEvent, TransferResult
from hicache.rpc import convert
from hicache.validate import is_int


class HiCacheRpcError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the sidecar's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class ReloadHandle:
    """A reload in progress. statuses[i] is LOADED, LOADED_FROM_STORAGE (fetched from the
    storage tier first) or NOT_FOUND for keys[i]; the loaded keys are a prefix of keys.

    Layer-wise reloads follow the sidecar's Watch stream in a thread; wait_layer(i) returns
    once pool-local layer i (0 .. layer_num-1) of every loaded page is on the device.
    """

    def __init__(self, result: TransferResult, layer_num: int, watch: Callable[[], Any] | None):
        self.statuses = result.statuses
        self.op_id = result.op_id
        self.bytes_copied = result.bytes_copied
        self.layer_num = layer_num
        self._cond = threading.Condition()
        self._layers_done = layer_num if result.done else 0
        self._finished = result.done
        self._error: str | None = None
        if not result.done:
            assert watch is not None
            threading.Thread(target=self._follow, args=(watch,), daemon=True, name="hicache-watch").start()

    def _follow(self, watch: Callable[[], Any]) -> None:
        try:
            for msg in watch():
                self._on_event(convert.event_from_pb(msg))
        except grpc.RpcError as exc:
            self._on_event(OpEvent("failed", error=f"{exc.code().name}: {exc.details()}"))
        with self._cond:
            if not self._finished:
                self._finished, self._error = True, self._error or "watch stream ended early"
            self._cond.notify_all()

    def _on_event(self, event: OpEvent) -> None:
        with self._cond:
            if event.kind == "layer_done":
                self._layers_done = max(self._layers_done, event.layers_done)
            elif event.kind == "done":
                self._layers_done, self._finished = self.layer_num, True
            else:
                self._finished, self._error = True, event.error or "reload failed"
            self._cond.notify_all()

    def done(self) -> bool:
        with self._cond:
            return self._finished

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until `layer` is reloaded. Raises ValueError for a bad layer, RuntimeError if
        the reload failed, TimeoutError after `timeout` s."""
        if not is_int(layer) or not 0 <= layer < self.layer_num:
            raise ValueError(f"layer {layer!r} out of range [0, {self.layer_num})")
        self._wait(lambda: self._layers_done > layer, timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every layer is reloaded (same errors as wait_layer)."""
        self._wait(lambda: self._finished, timeout)

    def _wait(self, ready: Callable[[], bool], timeout: float | None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: ready() or self._error is not None, timeout):
                raise TimeoutError(f"reload {self.op_id} not done after {timeout} s")
            if self._error is not None:
                raise RuntimeError(f"reload {self.op_id} failed: {self._error}")
