"""One registered pool on the sidecar: the engine's mapped device pool, its share of a host
cache (hicache.sidecar.shared_cache: the host mirror, its index and storage tier, shared by
every pool of one model and rank slice) and the transfers between them. Validates everything
before changing state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hicache.api import (
    CopyGrant,
    EvictResult,
    KeyStatus,
    LookupResult,
    PoolStats,
    PrefetchOutcome,
    Tier,
    TransferResult,
)
from hicache.cache.index import HostIndex
from hicache.cache.prefetch import PrefetchHandle
from hicache.memory.cuda_events import OpenedIpcEvents
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.sidecar.checks import check_keys, check_pages
from hicache.sidecar.errors import StateError
from hicache.sidecar.events import PoolEvents
from hicache.sidecar.grants import CopyGrants
from hicache.sidecar.layer_events import LayerEvents
from hicache.sidecar.operations import (
    Operation,
    OperationTable,
    PrefetchTable,
    copy_layers,
    offload_statuses,
    prefetch_statuses,
    reload_statuses,
)
from hicache.sidecar.pool_stats import Counters, pool_stats
from hicache.sidecar.progress_block import ProgressBlock
from hicache.sidecar.registration import PoolIdentity
from hicache.sidecar.shared_cache import SharedHostCache
from hicache.transfer import TransferEngine
from hicache.transfer.cuda import StreamHook
from hicache.transfer.engine import Backend
from hicache.transfer.handles import TransferHandle
from hicache.transfer.progress import ProgressWords
from hicache.validate import is_int


class RegisteredPool:
    """Thread-safe. The HierarchicalCache guards the host index and the storage tier; this
    object's lock guards only counters, operations, its pins and the closed flag, so copies
    run without it: an offload fills host pages reserved for it alone, and a reload reads
    host pages it holds references on, so nothing can evict or overwrite them meanwhile.
    """

    def __init__(
        self,
        identity: PoolIdentity,
        device: DeviceKVPool | None,
        shared: SharedHostCache,
        *,
        max_batch: int,
        finished_ops_kept: int,
        io_backend: Backend = "auto",
        clock: Callable[[], float] = time.monotonic,
        events: PoolEvents | None = None,
        offload_events: OpenedIpcEvents | None = None,
        layerwise_inline_bytes: int = 0,
        device_pages: int = 0,
        grant_ttl_s: float = 30.0,
    ):
        """`shared`: the host cache it joins (hicache.sidecar.shared_cache); StateError if that
        is closing. `events`: where the pool publishes KV events (registered now, unregistered
        at close, and every change of what its host index and storage tier hold). `offload_events`: the
        engine's interprocess CUDA events, opened (an OpenedIpcEvents, closed with the pool),
        that offloads wait for on the GPU. `layerwise_inline_bytes`: a layer-wise reload of
        fewer bytes is copied before the answer (CPU pools). device None: the engine's memory
        is not mapped (copy path "engine": the engine copies through grants, see grants.py);
        device_pages then says how many pages it has."""
        self.identity = identity
        self.device = device
        self.shared = shared
        cache = self.cache = shared.cache
        self.host: HostKVPool = shared.host
        self.engine = TransferEngine(device, self.host, io_backend) if device is not None else None
        self.geometry = cache.geometry
        self.device_pages = device.num_pages if device is not None else device_pages
        self.copy_path = "sidecar" if device is not None else "engine"
        self.grants = CopyGrants(cache, grant_ttl_s, clock)
        self.max_batch = max_batch
        self.counters = Counters()
        self.lock = threading.Lock()
        self._pins: Counter[bytes] = Counter()  # this member's pins (guarded by _pin_lock)
        self._pin_lock = threading.Lock()  # one pin or unpin of this pool at a time
        self.closed = False
        self._busy = 0  # calls and layer-wise workers in flight; close() waits for 0
        self._idle = threading.Condition(self.lock)
        self._released = threading.Event()  # set once close() has released everything
        self._ops = OperationTable(finished_ops_kept)
        self._prefetches = PrefetchTable(finished_ops_kept)
        self._clock = clock
        # where layer-wise reloads publish their layers for the engine (the native CPU path)
        self.progress = ProgressBlock() if self.engine is not None and self.engine.backend == "native" else None
        # CUDA pools: the layer events layer-wise reloads record for the engine's stream
        self.layer_events: LayerEvents | None = None
        if device is not None and device.flat.is_cuda:
            self.layer_events = LayerEvents(self.geometry.layer_num, device.flat.device.index or 0)
        self.offload_events = offload_events
        self.layerwise_inline_bytes = layerwise_inline_bytes
        self.events = events
        if not shared.join(identity.pool_id, self.geometry.pool_bytes(self.device_pages), events):
            self._close_copiers()
            raise StateError(f"host cache {shared.cache_id} closed while pool {identity.pool_id} joined it")

    @property
    def _copier(self) -> TransferEngine:
        assert self.engine is not None  # check_device refused a pool without a mapping
        return self.engine

    @property
    def index(self) -> HostIndex:
        return self.cache.index

    # ---- validation (no state changes) --------------------------------------------------
    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """Count the call as in flight (close() waits for it); StateError once closed."""
        with self.lock:
            if self.closed:
                raise StateError(f"pool {self.identity.pool_id} is closed")
            self._busy += 1
        try:
            yield
        finally:
            self._done_one()

    def _done_one(self) -> None:
        with self.lock:
            self._busy -= 1
            self._idle.notify_all()

    def check_keys(self, keys: Sequence[bytes], *, unique: bool = False) -> list[bytes]:
        return check_keys(keys, self.identity.key_bytes, self.identity.key_hash, self.max_batch, unique=unique)

    def check_pages(self, device_pages: Sequence[int], n: int) -> list[int]:
        return check_pages(device_pages, n, self.device_pages)

    def check_device(self) -> None:
        """Raises StateError when the engine changed its memory under the sidecar (a shared file
        shrunk below the mapped size): copying would fault the whole sidecar (SIGBUS). Only
        this pool's calls fail; the engine must register again. Call it in flight (_in_flight):
        once the pool is closed, the fds it checks are closed too. A pool whose engine copies
        itself has no mapping: ValueError, since the sidecar has nothing to copy with."""
        if self.device is None:
            raise ValueError(
                f"pool {self.identity.pool_id} copies in the engine (copy_path 'engine'): "
                "the engine copies through BeginCopy/EndCopy, not Offload/Reload"
            )
        problem = self.device.memory.damage()
        if problem:
            raise StateError(f"pool {self.identity.pool_id}: {problem}; register the pool again")

    # ---- transfers ------------------------------------------------------------------------
    def offload(self, keys: Sequence[bytes], device_pages: Sequence[int], ready_event: int = 0) -> TransferResult:
        """Copy device_pages[i] to host under keys[i]. A key already on host (or being filled)
        is DEDUPLICATED; keys past the free + evictable host pages are NO_SPACE (the earliest
        keys get stored). The write policy then decides what goes to storage. ready_event:
        1 + the index of the engine's offload event the copy waits for on the GPU; 0: none."""
        ks = self.check_keys(keys, unique=True)
        pages = self.check_pages(device_pages, len(ks))
        ready = self._ready_hook(ready_event)
        with self._in_flight():  # first: close() may have released the device memory
            self.check_device()
            return self._offload(ks, pages, ready)

    # ---- the engine's own copies (copy path "engine") ------------------------------------------
    def begin_copy(self, keys: Sequence[bytes], *, offload: bool) -> CopyGrant:
        """Grant host pages for the engine to copy into (offload) or out of (reload); see
        hicache.sidecar.grants. Any pool may be asked; one whose memory the sidecar cannot
        map can only be asked this."""
        ks = self.check_keys(keys, unique=True)
        with self._in_flight():
            grant = self.grants.offload(ks) if offload else self.grants.reload(ks)
        if offload:
            with self.lock:
                c = self.counters
                c.deduplicated += grant.statuses.count(KeyStatus.DEDUPLICATED)
                c.no_space += grant.statuses.count(KeyStatus.NO_SPACE)
        return grant

    def end_copy(self, grant_id: str, *, commit: bool, copy_seconds: float = 0.0) -> int:
        """End a grant (see CopyGrants.end); returns its pages. copy_seconds: the engine's
        copy time, for the pool's GB/s. Raises UnknownId for an unknown or expired grant."""
        if not isinstance(copy_seconds, float | int) or not 0 <= copy_seconds < float("inf"):
            raise ValueError(f"copy_seconds must be a finite number >= 0, got {copy_seconds!r}")
        with self._in_flight():
            offload, pages = self.grants.end(grant_id, commit)
        if commit:
            nbytes = pages * self.geometry.page_bytes
            with self.lock:
                c = self.counters
                if offload:
                    c.offload_bytes, c.offload_s, c.stored = (
                        c.offload_bytes + nbytes,
                        c.offload_s + copy_seconds,
                        c.stored + pages,
                    )
                else:
                    c.reload_bytes, c.reload_s = c.reload_bytes + nbytes, c.reload_s + copy_seconds
        return pages

    def _ready_hook(self, ready_event: int) -> StreamHook | None:
        """The copy stream's wait for the engine's event `ready_event` (1-based). Raises ValueError."""
        if ready_event == 0:
            return None
        count = len(self.offload_events) if self.offload_events is not None else 0
        if not is_int(ready_event) or not 1 <= ready_event <= count:
            raise ValueError(
                f"ready_event must be 0 or 1..{count} (the pool's registered offload events), got {ready_event!r}"
            )
        events, index = self.offload_events, ready_event - 1
        assert events is not None
        return lambda stream: events.wait(index, stream)

    def _offload(self, ks: list[bytes], pages: list[int], ready: StreamHook | None = None) -> TransferResult:
        where = dict(zip(ks, pages, strict=True))
        res = self.cache.reserve(ks, partial=True)
        assert res is not None
        t0 = time.perf_counter()
        try:
            nbytes = self._copier.offload([where[k] for k, _ in res.new], [p for _, p in res.new], ready=ready)
        except BaseException:
            self.cache.abort(res)
            raise
        self.cache.commit(res)
        seconds = time.perf_counter() - t0
        statuses = offload_statuses(res, ks)
        with self.lock:
            c = self.counters
            c.offload_bytes += nbytes
            c.offload_s += seconds if res.new else 0.0
            c.stored += len(res.new)
            c.deduplicated += len(res.existing) + len(res.pending)
            c.no_space += len(res.refused)
        return TransferResult(statuses, nbytes)

    def reload(self, keys: Sequence[bytes], device_pages: Sequence[int], *, layerwise: bool) -> TransferResult:
        """Copy the longest loadable prefix of `keys` into device_pages: keys on host are
        LOADED, keys only in storage are fetched into host first (LOADED_FROM_STORAGE), and
        every key from the first one in no tier on is NOT_FOUND (with chained keys a page
        after a gap is of no use).

        Not layer-wise: copies before returning (done=True). Layer-wise: returns at once
        with an op id; a worker copies one layer at a time and publishes each to Watch.
        """
        ks = self.check_keys(keys, unique=True)
        pages = self.check_pages(device_pages, len(ks))
        with self._in_flight():  # first: close() may have released the device memory
            self.check_device()
            return self._reload(ks, pages, layerwise)

    def _reload(self, ks: list[bytes], pages: list[int], layerwise: bool) -> TransferResult:
        self._copier.check_device_pages(pages)  # before load() fetches or evicts anything
        loaded = self.cache.load(ks)
        op = Operation("op-" + secrets.token_hex(8), self.geometry.layer_num)
        with self.lock:
            self._ops.add(op)
        n = len(loaded.keys)
        statuses = reload_statuses(loaded, len(ks))
        args = (op, loaded.keys, loaded.pages, pages[:n])
        nbytes = n * self.geometry.page_bytes
        if layerwise and self.progress is not None and nbytes < self.layerwise_inline_bytes:
            # as small as the engine copies in its calling thread: copied before the answer
            # (done), cheaper than a worker thread and the engine's layer waits
            layerwise = False
        if layerwise and self.progress is not None:
            return self._reload_layerwise(op, statuses, nbytes, args)
        if layerwise and self.layer_events is not None and n:
            return self._reload_with_events(op, statuses, nbytes, args)
        if not layerwise:
            try:
                self._copy_layers(*args, per_layer=False)
            except BaseException:
                self.cache.release(loaded.keys)
                raise
            self.cache.release(loaded.keys)
            return TransferResult(statuses, nbytes, op.op_id, True)
        return self._start_worker(op, statuses, nbytes, args, None)

    def _reload_layerwise(
        self, op: Operation, statuses: tuple[KeyStatus, ...], nbytes: int, args: tuple[Any, ...]
    ) -> TransferResult:
        """A layer-wise reload that also publishes into a progress-block slot (when one is
        free): the engine waits on the slot's words; Watch still has every event."""
        assert self.progress is not None
        progress = self.progress
        taken = progress.acquire()
        if taken is None:
            return self._start_worker(op, statuses, nbytes, args, None)
        slot, generation, words = taken
        _, keys, host_pages, dev_pages = args
        release = functools.partial(progress.release, slot)
        handle = self._start_copy(
            op, keys, lambda: self._copier.reload_async(host_pages, dev_pages, progress=words), release
        )  # started here, before the answer: no worker thread start ahead of the first layer
        result = self._start_worker(op, statuses, nbytes, args, release, handle, words=words)
        return dataclasses.replace(
            result, progress_slot=slot, progress_generation=generation, progress_words=len(words)
        )

    def _reload_with_events(
        self, op: Operation, statuses: tuple[KeyStatus, ...], nbytes: int, args: tuple[Any, ...]
    ) -> TransferResult:
        """A layer-wise reload on CUDA that records a slot of layer events (when one is free)
        before answering: the engine's stream waits for each layer on the GPU; a worker still
        follows the copy for Watch and frees the slot when it is done."""
        assert self.layer_events is not None
        events = self.layer_events
        slot = events.acquire()
        if slot is None:
            return self._start_worker(op, statuses, nbytes, args, None)
        _, keys, host_pages, dev_pages = args
        release = functools.partial(events.release, slot)
        handle = self._start_copy(
            op,
            keys,
            lambda: self._copier.reload_async(host_pages, dev_pages, after_layer=events.recorder(slot)),
            release,
        )
        result = self._start_worker(op, statuses, nbytes, args, release, handle)
        return dataclasses.replace(result, event_slot=slot, event_layers=self.geometry.layer_num)

    def _start_copy(
        self, op: Operation, keys: list[bytes], start: Callable[[], TransferHandle], release: Callable[[], None]
    ) -> TransferHandle:
        """start() a reload in the calling thread; if it raises, free its keys and its slot
        (`release`), mark the operation failed, and re-raise."""
        try:
            return start()
        except BaseException as exc:
            self.cache.release(keys)
            release()
            op.failed(f"{type(exc).__name__}: {exc}", 0)
            raise

    def _start_worker(
        self,
        op: Operation,
        statuses: tuple[KeyStatus, ...],
        nbytes: int,
        args: tuple[Any, ...],
        release: Callable[[], None] | None,
        started: TransferHandle | None = None,
        words: ProgressWords | None = None,
    ) -> TransferResult:
        """Run _reload_worker in a thread of its own (`release` frees its slot when it ends);
        answer with the op to Watch."""
        kwargs = {"release": release, "started": started, "words": words}
        worker = threading.Thread(target=self._reload_worker, args=args, kwargs=kwargs, daemon=True)
        with self.lock:
            self._busy += 1  # the worker's own count, dropped when it ends
        try:
            worker.start()
        except BaseException as exc:
            if started is not None:  # the copy is queued: its host pages stay held until it ends
                with contextlib.suppress(Exception):
                    started.wait()
            self.cache.release(args[1])
            self._done_one()
            if release is not None:
                release()
            op.failed(f"{type(exc).__name__}: {exc}", 0)
            raise
        return TransferResult(statuses, nbytes, op.op_id, False)

    def _reload_worker(
        self,
        op: Operation,
        keys: list[bytes],
        host_pages: list[int],
        dev_pages: list[int],
        *,
        release: Callable[[], None] | None = None,
        started: TransferHandle | None = None,
        words: ProgressWords | None = None,
    ) -> None:
        try:
            self._copy_layers(op, keys, host_pages, dev_pages, per_layer=True, progress=words, started=started)
        except Exception:
            pass  # already published to the operation as FAILED
        finally:
            self.cache.release(keys)
            if release is not None:
                release()
            self._done_one()

    def _copy_layers(
        self,
        op: Operation,
        keys: list[bytes],
        host_pages: list[int],
        dev_pages: list[int],
        *,
        per_layer: bool,
        progress: ProgressWords | None = None,
        started: TransferHandle | None = None,
    ) -> None:
        """Copy (one layer at a time when per_layer, publishing each), count, publish DONE or
        FAILED."""
        t0 = time.perf_counter()
        nbytes = copy_layers(
            self._copier, op, host_pages, dev_pages, per_layer=per_layer, progress=progress, started=started
        )
        with self.lock:
            self.counters.reload_bytes += nbytes
            self.counters.reload_s += time.perf_counter() - t0 if host_pages else 0.0
        op.done()

    # ---- index operations -------------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes], policy: str | None = None) -> PrefetchOutcome:
        """Fetch from storage into host the keys after the host-resident prefix that form a
        prefix present in storage. best_effort answers at once (FETCHING keys; Watch the op
        for progress); wait_complete waits for the end; timeout waits up to its allowance and
        cancels the rest. Per key: RESIDENT (on host already), FETCHING (by this or an earlier
        prefetch), FETCHED, NO_SPACE (in storage, but pinned or referenced pages fill the host
        pool), NOT_FOUND (in storage but not brought in: after a gap in the chain, or its
        fetch failed or was cancelled), MISSING (in no tier). Raises ValueError for a bad policy."""
        ks = self.check_keys(keys)
        with self._in_flight():
            return self._prefetch(ks, policy)

    def _prefetch(self, ks: list[bytes], policy: str | None) -> PrefetchOutcome:
        handle = self.cache.prefetch(ks, policy)
        with self.lock:
            op_id = self._prefetches.add(handle)
        timed_out = False
        if handle.policy != "best_effort":
            timed_out = handle.result().timed_out
        done = handle.wait(0)
        statuses = prefetch_statuses(handle, ks, self.cache.lookup(ks), done)
        return PrefetchOutcome(statuses, op_id, done, timed_out)

    def evict(self, keys: Sequence[bytes], num_pages: int) -> EvictResult:
        """Drop `keys` (EVICTED / NOT_FOUND / BUSY when pinned, being read or being written to
        storage), or, with no keys, free up to num_pages least recently used pages (write_back
        stores them first). Raises ValueError for both or neither."""
        ks = self.check_keys(keys)
        if not is_int(num_pages) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        if bool(ks) == bool(num_pages):
            raise ValueError(f"give either keys or num_pages, got {len(ks)} keys and num_pages={num_pages}")
        with self._in_flight():
            if not ks:
                return EvictResult((), self.cache.evict(num_pages))
            statuses = tuple(KeyStatus[s.upper()] for s in self.cache.drop(ks))
            return EvictResult(statuses, statuses.count(KeyStatus.EVICTED))

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Each key's tier, and the length of the prefix held by some tier (what a Reload can
        serve); the host-resident keys become most recently used."""
        ks = self.check_keys(keys)
        with self._in_flight():
            tiers = tuple(Tier(t) for t in self.cache.lookup(ks))
            self.cache.touch(ks)
        prefix = next((i for i, t in enumerate(tiers) if t == Tier.NONE), len(tiers))
        return LookupResult(prefix, tiers)

    def pin(self, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
        """Pin each resident key (PINNED, else NOT_FOUND). The pins are this pool's: other
        members of its host cache cannot unpin them, and they go when this pool does."""
        ks = self.check_keys(keys)
        with self._in_flight(), self._pin_lock:
            got = self.cache.pin_each(ks)
            self._pins.update(k for k, s in zip(ks, got, strict=True) if s == "pinned")
        return tuple(KeyStatus[s.upper()] for s in got)

    def unpin(self, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
        """Drop one of this pool's pins of each key: UNPINNED, NOT_PINNED (not pinned by this
        pool, whoever else did) or NOT_FOUND (not on host)."""
        ks = self.check_keys(keys)
        with self._in_flight(), self._pin_lock:
            left, mine = Counter(self._pins), []
            for k in ks:  # each listing of a key takes one of this pool's pins of it
                mine.append(left[k] > 0)
                left[k] -= 1
            ours = iter(self.cache.unpin_each([k for k, m in zip(ks, mine, strict=True) if m]))
            theirs = iter(self.cache.resident([k for k, m in zip(ks, mine, strict=True) if not m]))
            out = [next(ours) if m else "not_pinned" if next(theirs) else "not_found" for m in mine]
            self._pins.subtract(k for k, s in zip(ks, out, strict=True) if s == "unpinned")
            self._pins = +self._pins  # drop the keys at zero
        return tuple(KeyStatus[s.upper()] for s in out)

    def _unpin_all(self) -> None:
        """Drop every pin this pool still holds (it is leaving its host cache)."""
        with self._pin_lock:
            if self._pins:
                self.cache.unpin_each(list(self._pins.elements()))
            self._pins.clear()

    def operation(self, op_id: str) -> Operation | PrefetchHandle:
        """Raises KeyError for an unknown id."""
        with self.lock:
            handle = self._prefetches.find(op_id)
            return handle if handle is not None else self._ops.get(op_id)

    def stats(self) -> PoolStats:
        cs = self.cache.stats()
        with self.lock:
            in_flight = len(self._ops.in_flight()) + cs["prefetches_active"]
            return pool_stats(
                self.identity,
                self.cache,
                cs,
                self.counters,
                device_pages=self.device_pages,
                in_flight=in_flight + len(self.grants),
                copy_backend=self.engine.backend if self.engine is not None else "engine",
                copy_path=self.copy_path,
                cache_id=self.shared.cache_id,
                cache_members=self.shared.members,
            )

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def host_pages(self) -> int:
        """Host pages its cache can use now (a shared host budget moves it)."""
        return self.shared.host_pages

    def close(self) -> None:
        """Refuse new calls, let in-flight transfers finish, end its copy grants and pins,
        release the device mapping, and leave its host cache; the last member closes the
        cache (writes what is queued for storage, then releases the host memory and the
        tier). Each step runs even when one before it raised; the first error is raised at
        the end. Idempotent."""
        with self.lock:
            first = not self.closed
            self.closed = True
            if first:
                self._idle.wait_for(lambda: self._busy == 0)
        if not first:  # a concurrent close() releases; return when it has
            self._released.wait()
            return
        try:
            self.shared.leave(self.identity.pool_id, self.events, self._close_own)
        finally:
            self._released.set()

    def _close_own(self) -> None:
        """Release what is this member's alone, each step whatever an earlier one raised."""
        with contextlib.ExitStack() as steps:  # run in reverse order
            if self.device is not None:
                steps.callback(self.device.close)
            if self.offload_events is not None:
                steps.callback(self.offload_events.close)
            steps.callback(self._close_copiers)
            steps.callback(self._unpin_all)
            steps.callback(self.grants.close)

    def _close_copiers(self) -> None:
        with contextlib.ExitStack() as steps:
            for part in (self.engine, self.progress, self.layer_events):
                if part is not None:
                    steps.callback(part.close)

    def check_integrity(self) -> None:
        with self.lock:
            closed = self.closed
        if closed:
            self.index.check_integrity()
            return
        self.cache.check_integrity()
        assert self.host.geometry == self.geometry
        if self.device is not None:
            self.device.check_integrity()
            assert self.device.geometry == self.geometry
