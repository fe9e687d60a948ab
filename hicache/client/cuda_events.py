"""The CUDA events of this client's CUDA pools (see hicache.memory.cuda_events):

- offload events: a ring this process makes and registers; offload() records the next one
  on the caller's current stream and names it, so the sidecar's copy waits for the work
  queued before the call, on the GPU, with no host synchronization;
- layer events: the sidecar's, opened from RegisterPoolResponse; a layer-wise reload's
  wait_layer(i) makes the caller's current stream wait for layer i, on the GPU.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence

from hicache.memory.cuda_events import IpcEvents, OpenedIpcEvents

OFFLOAD_EVENTS = 32  # in the ring; an event is named again only after 31 later offloads

log = logging.getLogger("hicache.client")


def _current_stream(device: int) -> int:
    import torch  # a CUDA pool's caller has torch

    return int(torch.cuda.current_stream(device).cuda_stream)


class PoolCudaEvents:
    """One CUDA pool's events in this process. Thread-safe."""

    def __init__(self, device: int, offload: IpcEvents):
        self.device = device
        self.offload = offload
        self.layers: OpenedIpcEvents | None = None
        self.layer_num = 0
        self._next = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def create(cls, device: int) -> PoolCudaEvents:
        return cls(device, IpcEvents(OFFLOAD_EVENTS, device))

    def open_layer_events(self, handles: Sequence[bytes], slots: int) -> None:
        """Open the sidecar's layer events (slots x layer_num handles, slot-major). Events
        that cannot be opened (or a malformed answer) are logged and left out: the pool's
        layer-wise reloads are then followed through Watch."""
        if not handles and not slots:
            return
        if not slots or len(handles) % slots:
            log.warning("layer events not used: %d handles for %d slots", len(handles), slots)
            return
        try:
            self.layers = OpenedIpcEvents(handles, self.device, "layer_event_handles")
        except Exception as exc:
            log.warning("layer events not opened (%s): layer-wise reloads follow Watch", exc)
            return
        self.layer_num = len(handles) // slots

    def record_ready(self) -> int:
        """Record the next offload event on the current stream; its 1-based ready_event number.
        A pool's offloads must be recorded on one stream (or fewer than OFFLOAD_EVENTS be in
        flight at once): a re-record on another stream could let a late wait pass early."""
        with self._lock:
            index = next(self._next) % len(self.offload)
            self.offload.record(index, _current_stream(self.device))
        return index + 1

    def layer_waiter(self, slot: int, layers: int) -> Callable[[int], None] | None:
        """wait(layer): the current stream waits for `layer` of the reload in `slot`; None
        when the events do not cover it (Watch then)."""
        events = self.layers
        if events is None or layers != self.layer_num or not 0 <= slot < len(events) // max(1, layers):
            return None
        first = slot * layers
        return lambda layer: events.wait(first + layer, _current_stream(self.device))

    def close(self) -> None:
        self.offload.close()
        if self.layers is not None:
            self.layers.close()
