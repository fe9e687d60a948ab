"""PinLedger: who holds the page pins the vLLM manager took on the sidecar.

vLLM's own connector cannot take a failed load (its OffloadingConnectorWorker asserts on it, which
kills the worker), so a HIT must stay loadable: the lookup thread pins a chunk's pages on
every rank before it answers HIT, and the pins are held by that answer and by each load of
the chunk. A pin set whose last holder lets go waits in `released` until the manager unpins
it on its lookup thread. The ledger only counts; it makes no calls and takes no lock (the
manager calls it with its lock held).
"""

from __future__ import annotations

import logging
from collections.abc import Collection

log = logging.getLogger("hicache.integrations.vllm")


class ChunkPins:
    """The pins the lookup thread took on one chunk's pages, per rank pool. Held by the chunk's
    HIT answer and by each load of the chunk; unpinned once no holder is left."""

    __slots__ = ("holders", "pages")

    def __init__(self, pages: list[tuple[str, list[bytes]]]):
        self.pages, self.holders = pages, 1


class PinLedger:
    def __init__(self) -> None:
        self.held: dict[bytes, ChunkPins] = {}  # the pins behind each HIT answer
        # (req id, its chunk keys) -> pins: vLLM hands prepare_load a list and complete_load a set of
        # the same keys, so a load is known by the set
        self.loads: dict[tuple[str, frozenset[bytes]], list[list[ChunkPins]]] = {}
        self.released: list[ChunkPins] = []  # no holder left: to unpin on the lookup thread

    def pinned_pages(self) -> int:
        """How many page pins are held (answers and loads) or released and not unpinned yet."""
        with_holders = {id(p): p for p in self.held.values()}
        with_holders.update((id(p), p) for loads in self.loads.values() for pins in loads for p in pins)
        return sum(len(keys) for p in [*with_holders.values(), *self.released] for _, keys in p.pages)

    def drop(self, pins: ChunkPins) -> None:
        """One holder of `pins` is done; with none left they go to `released`."""
        pins.holders -= 1
        if pins.holders == 0:
            self.released.append(pins)

    def drop_answer(self, key: bytes) -> None:
        """The HIT answer for chunk `key`, if any, lets go of its pins."""
        pins = self.held.pop(key, None)
        if pins is not None:
            self.drop(pins)

    def drop_answers(self) -> None:
        """Every HIT answer lets go of its pins."""
        for pins in self.held.values():
            self.drop(pins)
        self.held.clear()

    def take_released(self) -> list[ChunkPins]:
        """The pins no one holds, to unpin; `released` is empty after."""
        released, self.released = self.released, []
        return released

    def start_load(self, req_id: str, keys: Collection[bytes]) -> None:
        """A load of `keys` for request `req_id` shares the pins of their HIT answers."""
        taken: list[ChunkPins] = []
        for key in keys:
            pins = self.held.get(key)
            if pins is None:  # vLLM loads only chunks answered HIT in this step: not expected
                log.error("hicache: vLLM loads chunk %s that holds no pins; the load may fail", bytes(key).hex())
                continue
            pins.holders += 1
            taken.append(pins)
        self.loads.setdefault((req_id, frozenset(keys)), []).append(taken)

    def end_load(self, req_id: str, keys: Collection[bytes]) -> bool:
        """Let go of the pins the oldest such load took (only those: another load may share the
        chunks). False when no load of `keys` for `req_id` is open."""
        key = (req_id, frozenset(keys))
        loads = self.loads.get(key)
        if not loads:
            return False
        for pins in loads.pop(0):
            self.drop(pins)
        if not loads:
            del self.loads[key]
        return True

    def loading(self, req_ids: Collection[str]) -> list[bytes]:
        """The chunk keys of the open loads for `req_ids`."""
        return [k for (rid, keys) in self.loads for k in keys if rid in req_ids]

    def take_all(self) -> list[ChunkPins]:
        """Every pin set, held or released, to unpin at shutdown; the ledger is empty after."""
        held = {id(p): p for p in self.held.values()}
        held.update((id(p), p) for loads in self.loads.values() for pins in loads for p in pins)
        released = [*self.released, *held.values()]
        self.held.clear()
        self.loads.clear()
        self.released.clear()
        return released
