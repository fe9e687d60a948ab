"""A pool's progress block: shared memory the engine maps at registration, where the
sidecar's copy publishes each layer-wise reload's progress, so that an engine waits for a
layer on a futex in its own process instead of on a gRPC stream message per layer.

The block is SLOTS slots of 16 32-bit words: word 0 is the slot's generation (bumped each
time it is handed to a reload), words 1.. are the reload's progress words (one for a native
copy; hicache.transfer.progress). ReloadResponse names the slot, its generation and how
many words the reload uses. Slots are reused oldest first; a reader that finds another
generation in its slot (a reload long finished) asks Watch instead.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from hicache.memory import create_shm
from hicache.transfer.progress import SLOT_WORDS, ProgressWords

SLOTS = 256
MAX_WORDS = SLOT_WORDS - 1


class ProgressBlock:
    """Thread-safe. close() unlinks the segment."""

    def __init__(self, slots: int = SLOTS):
        # not freed on close: an engine waiting in a slot then still reads it as it was, and
        # finds the sidecar gone by probing it
        self.memory = create_shm(slots * SLOT_WORDS * 4, free_on_close=False)
        self.words = self.memory.tensor.numpy().view(np.uint32).reshape(slots, SLOT_WORDS)
        self._lock = threading.Lock()
        self._free = deque(range(slots))
        self._generation = 0

    @property
    def name(self) -> str:
        return self.memory.handle.name

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    def acquire(self, count: int = 1) -> tuple[int, int, ProgressWords] | None:
        """(slot, generation, the slot's first `count` progress words, zeroed), or None when
        every slot is in use (the reload then reports through Watch only). A native copy
        counts into one word; a reader waits for every word the answer names."""
        count = max(1, min(count, MAX_WORDS))
        with self._lock:
            if not self._free:
                return None
            slot = self._free.popleft()
            self._generation = self._generation % 0xFFFFFFFE + 1
            generation = self._generation
        row = self.words[slot]
        words = ProgressWords(row[1 : 1 + count])
        ProgressWords(row[:1]).publish(0, 0)  # first invalid: a reader of the old reload stops trusting it
        row[1:] = 0
        words.publish(0, 0)  # a fence: the zeros are visible before the new generation
        ProgressWords(row[:1]).publish(0, generation)
        return slot, generation, words

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def close(self) -> None:
        self.memory.close()
