"""CUDA events shared between processes (cudaEventInterprocess, through cupy).

One process creates and records the events (IpcEvents); another opens them by their IPC
handles (OpenedIpcEvents) and orders its own streams after them with cudaStreamWaitEvent,
so that neither side synchronizes the host to hand work over:
- a layer-wise reload: the sidecar records event i after copying layer i; the engine's
  stream waits for it before layer i's attention;
- an offload: the engine records an event after the forward that wrote the pages; the
  sidecar's copy stream waits for it before reading them.

A wait captures the event's newest record at the time of the call. Both protocols send the
message that names an event after recording it, and a re-record is later work on the same
stream (the sidecar's one load stream; for offloads, the engine must record a pool's events
on one stream, or keep fewer offloads in flight than its ring holds), so a late re-record
can only make a wait longer, never let it pass early.
Importable without CUDA: cupy is imported when events are made or opened.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)


def _cupy() -> Any:
    import cupy  # type: ignore[import-not-found]

    return cupy


def check_event_handles(field: str, handles: Sequence[bytes], limit: int) -> None:
    """Raise ValueError naming `field` unless handles are at most `limit` handles of 64 bytes."""
    if len(handles) > limit:
        raise ValueError(f"{field}: at most {limit} event handles, got {len(handles)}")
    for i, handle in enumerate(handles):
        if not isinstance(handle, bytes) or len(handle) != EVENT_HANDLE_BYTES:
            size = len(handle) if isinstance(handle, bytes) else type(handle).__name__
            raise ValueError(f"{field}[{i}] must be a {EVENT_HANDLE_BYTES}-byte CUDA IPC event handle, got {size}")


class _Events:
    """A list of CUDA events (cudaEvent_t as ints) this process destroys when closed."""

    _events: list[int]

    def __len__(self) -> int:
        return len(self._events)

    def close(self) -> None:
        """Destroy every event (each tried, the first failure raised after). Idempotent."""
        rt = _cupy().cuda.runtime
        events, self._events = self._events, []
        failure: BaseException | None = None
        for event in events:
            try:
                rt.eventDestroy(event)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure


class IpcEvents(_Events):
    """`count` interprocess events made by this process on CUDA device `device`."""

    def __init__(self, count: int, device: int = 0):
        cp = _cupy()
        rt = cp.cuda.runtime
        self.device = device
        self._events = []
        try:
            with cp.cuda.Device(device):
                for _ in range(count):
                    self._events.append(rt.eventCreateWithFlags(rt.eventDisableTiming | rt.eventInterprocess))
                self.handles = [bytes(rt.ipcGetEventHandle(e)) for e in self._events]
        except BaseException:
            self.close()
            raise

    def record(self, index: int, stream: int) -> None:
        """Record event `index` on `stream` (a cudaStream_t as an int)."""
        _cupy().cuda.runtime.eventRecord(self._events[index], stream)


class OpenedIpcEvents(_Events):
    """Events another process made, opened here from their IPC handles. Raises ValueError
    for a malformed handle (nothing stays open)."""

    def __init__(self, handles: Sequence[bytes], device: int = 0, field: str = "event handles"):
        check_event_handles(field, handles, len(handles))
        cp = _cupy()
        self._events = []
        try:
            with cp.cuda.Device(device):
                for handle in handles:
                    self._events.append(int(cp.cuda.runtime.ipcOpenEventHandle(handle)))
        except BaseException:
            self.close()
            raise

    def wait(self, index: int, stream: int) -> None:
        """Make `stream` wait (on the GPU) for the newest record of event `index`."""
        _cupy().cuda.runtime.streamWaitEvent(stream, self._events[index], 0)
