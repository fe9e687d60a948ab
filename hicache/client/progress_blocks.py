"""The progress blocks of this client's pools, mapped from the sidecar's shared memory (see
hicache.sidecar.progress_block): where a layer-wise reload's layers are waited on."""

from __future__ import annotations

import logging

import numpy as np

from hicache.client.handles import ProgressSlot
from hicache.memory import SharedBuffer, open_shm
from hicache.transfer import native
from hicache.transfer.progress import SLOT_WORDS

log = logging.getLogger("hicache.client")


class ProgressBlocks:
    """Pool id -> its mapped block. A block that cannot be mapped (the sidecar on another
    host or in another IPC namespace, or no native copy path here to wait on a futex) is
    left out: its reloads are followed through Watch."""

    def __init__(self) -> None:
        self._blocks: dict[str, tuple[SharedBuffer, np.ndarray]] = {}

    def map(self, pool_id: str, name: str, nbytes: int) -> None:
        if not name or not native.available() or nbytes % (SLOT_WORDS * 4):
            return
        try:
            memory = open_shm(name, nbytes)
        except (OSError, ValueError) as exc:
            log.info("progress block %s not mapped (%s): layer-wise reloads follow Watch", name, exc)
            return
        self._blocks[pool_id] = (memory, memory.tensor.numpy().view(np.uint32).reshape(-1, SLOT_WORDS))

    def slot(self, pool_id: str, index: int, generation: int, words: int) -> ProgressSlot | None:
        block = self._blocks.get(pool_id)
        if block is None or not 0 <= index < len(block[1]) or not 0 < words < SLOT_WORDS:
            return None
        return ProgressSlot(block[1][index], generation, words)

    def unmap(self, pool_id: str) -> None:
        block = self._blocks.pop(pool_id, None)
        if block is not None:
            block[0].close()

    def close(self) -> None:
        for pool_id in list(self._blocks):
            self.unmap(pool_id)
