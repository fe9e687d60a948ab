"""Asynchronous operations a client can Watch (layer-wise reloads and prefetches), their
progress events, and the per-key answer of a prefetch."""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from hicache.api import KeyStatus, OpEvent
from hicache.cache.prefetch import PrefetchHandle
from hicache.cache.results import LoadResult, Reservation
from hicache.sidecar.errors import UnknownId
from hicache.transfer.progress import FAILED, ProgressWords

T = TypeVar("T")

if TYPE_CHECKING:
    from hicache.transfer import TransferEngine
    from hicache.transfer.handles import TransferHandle


class Operation:
    """An operation's event log: LAYER_DONE events, then one DONE or FAILED. Thread-safe."""

    def __init__(self, op_id: str, layer_num: int):
        self.op_id = op_id
        self.layer_num = layer_num
        self._cond = threading.Condition()
        self._events: list[OpEvent] = []
        self._finished = False

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._finished

    def layer_done(self, layer: int, layers_done: int) -> None:
        self._publish(OpEvent("layer_done", layer, layers_done, self.layer_num))

    def all_layers_done(self) -> None:
        """Every layer's LAYER_DONE at once, under one lock and one wake-up (a copy that did
        not go layer by layer: Watch still carries every layer)."""
        n = self.layer_num
        with self._cond:
            assert not self._finished, f"operation {self.op_id} already finished"
            self._events.extend(OpEvent("layer_done", layer, layer + 1, n) for layer in range(n))
            self._cond.notify_all()

    def done(self) -> None:
        self._publish(OpEvent("done", 0, self.layer_num, self.layer_num))

    def failed(self, error: str, layers_done: int) -> None:
        self._publish(OpEvent("failed", 0, layers_done, self.layer_num, error))

    def _publish(self, event: OpEvent) -> None:
        with self._cond:
            assert not self._finished, f"operation {self.op_id} already finished"
            self._events.append(event)
            self._finished = event.kind != "layer_done"
            self._cond.notify_all()

    def events_since(self, start: int, timeout: float | None) -> tuple[list[OpEvent], bool]:
        """Events from index `start` on, waiting up to `timeout` s for one; and whether finished."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._events) > start or self._finished, timeout)
            return self._events[start:], self._finished

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished; returns whether it did within `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._finished, timeout)


def copy_layers(
    engine: TransferEngine,
    op: Operation,
    host_pages: list[int],
    dev_pages: list[int],
    *,
    per_layer: bool,
    progress: ProgressWords | None = None,
    started: TransferHandle | None = None,
) -> int:
    """Reload host_pages into dev_pages, publishing each finished layer to `op` (layer by
    layer as the copy goes when per_layer, else all at the end), and, per_layer, into the
    `progress` words (a progress-block slot the engine waits on); returns the bytes copied.
    `started`: that layer-wise reload, already started by the caller. A failure is published
    as FAILED (and FAILED into the words, once a copy already started has ended, so that
    nothing publishes over it) and re-raised; DONE is the caller's to publish."""
    handle = started
    try:
        if per_layer:
            if handle is None:
                handle = engine.reload_async(host_pages, dev_pages, progress=progress)
            for layer in range(op.layer_num):
                handle.wait_layer_host(layer)  # on CUDA too: the engine reads it once announced
                op.layer_done(layer, layer + 1)
            handle.wait()
            return handle.nbytes
        nbytes = engine.reload(host_pages, dev_pages)
        op.all_layers_done()
        return nbytes
    except Exception as exc:
        if handle is not None:  # a copy still running would publish over FAILED (and the caller
            with contextlib.suppress(Exception):  # frees its pages): let it end first
                handle.wait()
        if progress is not None:
            progress.publish_all(FAILED)  # a wait on the words ends; Watch says why
        op.failed(f"{type(exc).__name__}: {exc}", 0)
        raise


def prune_finished(table: OrderedDict[str, T], finished: Callable[[T], bool], keep: int) -> None:
    """Drop the oldest finished entries of `table` beyond the newest `keep` finished ones,
    once it holds more than twice `keep` (a walk of the whole table on every add cost a
    layer-wise reload 0.3 ms at the default 256)."""
    if len(table) <= 2 * keep:
        return
    done = [k for k, v in table.items() if finished(v)]
    for key in done[: max(0, len(done) - keep)]:
        del table[key]


class OperationTable:
    """Operations by id; keeps every unfinished one and at least the newest `keep_finished`
    finished (pruned to that once the table holds twice as many)."""

    def __init__(self, keep_finished: int):
        self.keep_finished = keep_finished
        self._ops: OrderedDict[str, Operation] = OrderedDict()
        # ids: a random prefix per table and a count, not secrets.token_hex per operation:
        # os.urandom lets go of the GIL, and a reload would wait to take it back beside a busy
        # thread. Unique within the pool (and, by the prefix, across its registrations); an
        # id grants nothing, since every call on the pool needs its secret.
        self._prefix = "op-" + secrets.token_hex(4)
        self._count = itertools.count()

    def new_id(self) -> str:
        """A fresh operation id ("op-" and 16 hex digits)."""
        return f"{self._prefix}{next(self._count):08x}"

    def add(self, op: Operation) -> None:
        self._ops[op.op_id] = op
        prune_finished(self._ops, lambda o: o.finished, self.keep_finished)

    def get(self, op_id: str) -> Operation:
        op = self._ops.get(op_id)
        if op is None:
            raise UnknownId(f"unknown operation id {op_id!r}")
        return op

    def in_flight(self) -> list[Operation]:
        return [o for o in self._ops.values() if not o.finished]


class PrefetchTable:
    """Prefetch handles by op id ("pf-<id>"); keeps every unfinished one and at least the
    newest `keep_finished` finished (as OperationTable). Not locked: the pool's lock guards it."""

    def __init__(self, keep_finished: int):
        self.keep_finished = keep_finished
        self._handles: OrderedDict[str, PrefetchHandle] = OrderedDict()

    def add(self, handle: PrefetchHandle) -> str:
        op_id = f"pf-{handle.id}"
        self._handles[op_id] = handle
        prune_finished(self._handles, lambda h: h.wait(0), self.keep_finished)
        return op_id

    def find(self, op_id: str) -> PrefetchHandle | None:
        return self._handles.get(op_id)


def offload_statuses(res: Reservation, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
    """Each key's offload answer from its reservation: STORED (reserved for it), NO_SPACE (no
    room left), DEDUPLICATED (on host already, or being filled)."""
    status = {k: KeyStatus.STORED for k, _ in res.new}
    status.update({k: KeyStatus.NO_SPACE for k in res.refused})
    return tuple(status.get(k, KeyStatus.DEDUPLICATED) for k in keys)


def reload_statuses(loaded: LoadResult, n_keys: int) -> tuple[KeyStatus, ...]:
    """Each of n_keys keys' reload answer: LOADED or LOADED_FROM_STORAGE for the loaded
    prefix, NOT_FOUND from the first gap on."""
    hits = [KeyStatus.LOADED if src == "host" else KeyStatus.LOADED_FROM_STORAGE for src in loaded.sources]
    return tuple(hits + [KeyStatus.NOT_FOUND] * (n_keys - len(hits)))


def prefetch_statuses(
    handle: PrefetchHandle, keys: Sequence[bytes], tiers: Sequence[str], done: bool
) -> tuple[KeyStatus, ...]:
    """Each key's prefetch answer, given where it is now (`tiers`, as cache.lookup says) and
    whether `handle` has finished: FETCHING (by this or an earlier prefetch still running),
    FETCHED, RESIDENT, NO_SPACE (pinned or referenced pages fill the host pool), NOT_FOUND
    (in storage but not brought in: after a gap, failed or cancelled) or MISSING (no tier)."""
    mine = set(handle.fetch)
    theirs = {k for h in handle.depends if not h.wait(0) for k in h.fetch}
    no_room = set(handle.no_room)

    def status(k: bytes, tier: str) -> KeyStatus:
        if k in mine and not done:
            return KeyStatus.FETCHING
        if k in mine:
            return KeyStatus.FETCHED if tier == "host" else KeyStatus.NOT_FOUND
        if tier == "host":
            return KeyStatus.RESIDENT
        if k in theirs:
            return KeyStatus.FETCHING
        if k in no_room:
            return KeyStatus.NO_SPACE
        return KeyStatus.NOT_FOUND if tier == "storage" else KeyStatus.MISSING

    return tuple(status(k, t) for k, t in zip(keys, tiers, strict=True))


def operation_events(op: Operation | PrefetchHandle, cancelled: Callable[[], bool], poll_s: float) -> Iterator[OpEvent]:
    """Every event of `op` from its start, blocking (poll_s at a time) for new ones, until it
    finishes or cancelled() is true: a reload's per-layer events, or a prefetch's progress."""
    if isinstance(op, PrefetchHandle):
        yield from _prefetch_events(op, cancelled, poll_s)
        return
    seen = 0
    while not cancelled():
        new, finished = op.events_since(seen, poll_s)
        seen += len(new)
        yield from new
        if finished and not new:
            return


def _prefetch_events(handle: PrefetchHandle, cancelled: Callable[[], bool], poll_s: float) -> Iterator[OpEvent]:
    """A prefetch's progress: a "progress" event (pages done of total) per change, then
    "done", or "failed" naming the pages not fetched."""
    seen = None
    while not cancelled():
        status = handle.wait_for_update(seen, poll_s)
        if status == seen:
            continue
        seen = status
        if not status.finished:
            yield OpEvent("progress", 0, status.done, status.total)
            continue
        if status.failed:
            yield OpEvent(
                "failed", 0, status.done, status.total, f"{status.failed} of {status.total} pages not fetched"
            )
        else:
            yield OpEvent("done", 0, status.done, status.total)
        return
