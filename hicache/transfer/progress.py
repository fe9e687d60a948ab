"""Progress words: 32-bit counters of layers done, written by the C copy (copy_pieces) after
each layer and waited on with a futex, without the GIL (wait_progress).

A transfer has k words (k >= 1): layer i is in place once every word is > i. The native copy
counts into the first word and sets the others to the layer count when it starts; the torch
path raises them all together. FAILED in a word means the transfer failed (the
waiter then asks for the error elsewhere). The words may live in private memory (one
process) or in a shared-memory progress block that an engine maps (hicache.sidecar.progress).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from hicache.transfer import native

FAILED = 0xFFFFFFFF
SLOT_WORDS = 16  # a progress-block slot (64 bytes): its generation, then up to 15 progress words


class ProgressWords:
    """k words in `array` (uint32, kept alive by this object)."""

    def __init__(self, array: np.ndarray):
        if array.dtype != np.uint32 or array.ndim != 1 or array.size < 1:
            raise ValueError(f"progress words must be a 1-d uint32 array, got {array.dtype} {array.shape}")
        self.array = array
        base = array.ctypes.data
        self.addresses = [base + 4 * i for i in range(array.size)]

    @classmethod
    def private(cls, count: int) -> ProgressWords:
        return cls(np.zeros(count, dtype=np.uint32))

    def __len__(self) -> int:
        return int(self.array.size)

    def reset(self) -> None:
        self.array[:] = 0

    def publish(self, index: int, value: int) -> None:
        """Store value into word `index` and wake its waiters."""
        if native.available():
            native.publish(self.addresses[index], value)
        else:
            self.array[index] = value

    def publish_all(self, value: int) -> None:
        for i in range(len(self)):
            self.publish(i, value)

    def done(self) -> int:
        """Layers done by every word (the least of them); FAILED if one says so."""
        values = [int(v) for v in self.array]
        return FAILED if FAILED in values else min(values)

    def wait(self, target: int, timeout: float | None, valid: Callable[[], bool] | None = None) -> bool:
        """Until every word is >= target (FAILED counts), at most `timeout` s; whether it was.
        `valid`: checked between waits (at least every second); False ends the wait (the
        words were handed to someone else)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for addr, word in zip(self.addresses, range(len(self)), strict=True):
            while int(self.array[word]) < target:
                left = -1.0 if deadline is None else deadline - time.monotonic()
                if (deadline is not None and left <= 0) or (valid is not None and not valid()):
                    return False
                if native.available():
                    native.wait_progress(addr, target, min(left, 1.0) if left >= 0 else 1.0)
                else:
                    time.sleep(0.0002)
        return True
