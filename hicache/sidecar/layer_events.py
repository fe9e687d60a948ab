"""A CUDA pool's layer events: the GPU counterpart of the progress block.

SLOTS slots of layer_num interprocess CUDA events, exported at registration
(RegisterPoolResponse.layer_event_handles, slot-major). A layer-wise reload takes a free
slot, records event i on the sidecar's copy stream once layer i's copy is queued, and names
the slot in its answer, sent after every event is recorded: the engine's stream waits for
layer i on the GPU (cudaStreamWaitEvent), with no message and no host synchronization per
layer. The slot is freed when the sidecar has seen the copy finish; a later reload in the
same slot records later work on the same stream, so a wait that comes late only waits longer.
When every slot is in use, the reload reports through Watch alone.
"""

from __future__ import annotations

import threading
from collections import deque

from hicache.memory.cuda_events import IpcEvents
from hicache.transfer.cuda import LayerHook

SLOTS = 16


class LayerEvents:
    """Thread-safe. close() destroys the events."""

    def __init__(self, layer_num: int, device: int, slots: int = SLOTS):
        self.layer_num, self.slots = layer_num, slots
        self.events = IpcEvents(slots * layer_num, device)
        self._lock = threading.Lock()
        self._free = deque(range(slots))

    @property
    def handles(self) -> list[bytes]:
        return self.events.handles

    def acquire(self) -> int | None:
        """A free slot, or None when every one is in use."""
        with self._lock:
            return self._free.popleft() if self._free else None

    def recorder(self, slot: int) -> LayerHook:
        """The after_layer hook that records the slot's event for each layer on the copy stream."""
        first = slot * self.layer_num
        return lambda position, stream: self.events.record(first + position, stream)

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def close(self) -> None:
        self.events.close()
