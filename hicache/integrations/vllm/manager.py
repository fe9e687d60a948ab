"""HiCacheOffloadingManager: vLLM's scheduler-side view of what the sidecar holds.

vLLM asks lookup() one chunk at a time, holding the scheduler. So a chunk the manager has
not seen answers RETRY, and at the end of the step background Lookups on each worker pool
(BATCH page keys per call, see batches) resolve every chunk asked for: HIT when each rank
holds all its pages in host memory, once pages only in storage are prefetched (waiting up to
the sidecar's prefetch timeout), MISS otherwise. Answers are reused for lookup_ttl_s from the
end of the first scheduling pass after they arrive (MAX_STEP_S at most before it): on a busy
CPU a step can outlast the TTL, and an answer that expired unseen deferred its request again,
step after step.

A HIT must stay loadable (pin_ledger says why): the lookup thread pins a chunk's pages on
every rank before it answers HIT (rank_pools; a chunk whose pin fails is a MISS), a load
shares those pins until complete_load, and they are released (off the scheduler thread)
once no load holds them and the answer has expired, or a load used it (at the step's end).
A sidecar that fails a call makes every lookup a MISS and every store a refusal for
retry_s; no call here raises into the scheduler.

The lookup thread and vLLM's scheduler share its state under `lock` (re-entrant): vLLM 0.33
holds it around its calls; on 0.32 each entry point takes it (compat).

With vLLM's KV events on (--kv-events-config), take_events reports what the sidecar holds of
the chunks vLLM stored or looked up: stores and removals, host pool as Medium.CPU and
storage tier as Medium.STORAGE, from the sidecar's own event stream (events.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from hicache.client import HiCacheClient
from hicache.integrations.vllm import compat
from hicache.integrations.vllm.batches import BATCH
from hicache.integrations.vllm.events import ChunkResidency, SidecarEventFeed, offloading_events
from hicache.integrations.vllm.load_store_spec import HiCacheLoadStoreSpec
from hicache.integrations.vllm.lookup_thread import LookupThread
from hicache.integrations.vllm.options import Options
from hicache.integrations.vllm.pin_ledger import ChunkPins, PinLedger
from hicache.integrations.vllm.rank_pools import RankPools

log = logging.getLogger("hicache.integrations.vllm")
SWEEP_MARGIN_S = 0.05  # the sweep of unused answers runs this long after they expire
MAX_STEP_S = 30.0  # how long an answer waits for a scheduling pass (an idle engine runs none)


# vLLM's calls into the manager that touch its state (not shutdown, which takes the lock itself)
ENTRY_POINTS = (
    "lookup", "on_schedule_end", "has_pending_work", "prepare_load", "complete_load", "prepare_store",
    "complete_store", "take_events", "reset_cache",
)  # fmt: skip


@compat.locked_entry_points(ENTRY_POINTS)
class HiCacheOffloadingManager(OffloadingManager):  # type: ignore[misc]
    def __init__(self, options: Options, config: OffloadingConfig, client: HiCacheClient):
        self.options, self.config, self.client = options, config, client
        self.blocks_per_chunk = config.cache.blocks_per_chunk
        self._lock = threading.RLock()  # vLLM's calls hold it (see compat); the lookup thread takes it too
        self._known: dict[bytes, tuple[LookupResult, float]] = {}  # chunk -> answer, until
        self._unseen: dict[bytes, float] = {}  # answers no scheduling pass has seen yet -> their TTL
        self._pins = PinLedger()  # its `held`: the pins behind each HIT answer in _known
        self._pending: dict[bytes, None] = {}
        self._loaded: set[bytes] = set()  # chunks loads took this step: their answers go at its end
        self._inflight: Future[None] | None = None
        self._thread = LookupThread()
        self._closed, self._down_until = False, 0.0
        self._failing = False  # since the last lookup that succeeded (the failure was logged)
        self.residency: ChunkResidency | None = None  # with vLLM's KV events on: what the sidecar holds
        self.feed: SidecarEventFeed | None = None
        if config.enable_kv_cache_events:
            self._follow_events()
        self._ranks = RankPools(options, config, client, self.residency)

    def _follow_events(self) -> None:
        world = self.config.parallel.world_size
        self.residency = ChunkResidency(self.blocks_per_chunk, world)
        if not self.options.admin_token:
            log.warning(
                "vLLM's KV events are on, but hicache reports none: the sidecar's KV events need its "
                "admin token ('admin_token' in kv_connector_extra_config or $HICACHE_ADMIN_TOKEN)"
            )
            return
        self.feed = SidecarEventFeed(self.options, self.config.engine_id, world, self.residency)
        self.feed.start()

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def pinned_pages(self) -> int:
        """How many page pins this manager holds on the sidecar (answers and loads)."""
        return self._pins.pinned_pages()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        now = time.monotonic()
        known = self._known.get(key)
        if known is not None and known[1] > now:
            return known[0]
        if now < self._down_until:
            return LookupResult.MISS
        self._pending[key] = None
        return LookupResult.RETRY

    def on_schedule_end(self, context: Any) -> None:
        now = time.monotonic()
        for key, ttl in self._unseen.items():  # this pass could use them: their TTL runs from now
            if (known := self._known.get(key)) is not None:
                self._known[key] = (known[0], now + ttl)
        self._unseen.clear()
        for key in self._loaded:  # its loads hold the pins now; a later lookup asks the sidecar
            self._known.pop(key, None)
            self._pins.drop_answer(key)
        self._loaded.clear()
        self._expire(now)
        if self._pending and (self._inflight is None or self._inflight.done()):
            keys, self._pending = list(self._pending), {}
            self._inflight = self._thread.submit(self._resolve, keys)
        self._flush()

    def has_pending_work(self) -> bool:
        return bool(self._pending) or (self._inflight is not None and not self._inflight.done())

    def _resolve(self, keys: list[bytes]) -> None:
        """Runs on the lookup thread: ask every rank's pool, pin the hits, then publish under
        the lock."""
        failed: Exception | None = None
        pins: dict[bytes, ChunkPins] = {}
        if self.residency is not None:  # before the sidecar is asked: its events count from now
            self.residency.track(keys)
        try:
            answers, ttl = self._ranks.ask(keys, pins, BATCH), self.options.lookup_ttl_s
        except Exception as exc:  # a down sidecar, or anything else: misses, never a raise
            failed, answers, ttl = exc, dict.fromkeys(keys, LookupResult.MISS), self.options.retry_s
        now = time.monotonic()
        with self._lock:
            if failed is not None:
                self._fail("lookup", failed)
            else:
                self._failing = False
            for key, answer in answers.items():
                self._pending.pop(key, None)  # asked again while this was resolved: answered now
                self._pins.drop_answer(key)  # an expired answer asked again: its pins go
                self._known[key] = (answer, now + MAX_STEP_S)
                self._unseen[key] = ttl
                if answer is LookupResult.HIT:
                    self._pins.held[key] = pins.pop(key)
            self._pins.released += pins.values()  # the pins of chunks that are not HITs
            self._expire(now)
            released = self._pins.take_released()
        self._unpin(released)
        self._arm()

    def _fail(self, what: str, exc: Exception) -> None:
        """Misses for retry_s. Called with the lock held. An outage is logged once (until a
        lookup succeeds again); workers that are not registered (LookupError) said why themselves."""
        self._down_until = time.monotonic() + self.options.retry_s
        self._ranks.pools = None  # a restarted sidecar gives the workers new pool ids
        if self._failing or isinstance(exc, LookupError):
            log.debug("hicache %s failed (%s); misses for %.0f s", what, exc, self.options.retry_s)
        else:
            log.warning(
                "hicache %s failed (%s); misses until it answers (asked every %.0f s)", what, exc, self.options.retry_s
            )
        self._failing = True

    def _expire(self, now: float) -> None:
        """Drop the pins of expired HIT answers. Called with the lock held."""
        for key in [k for k in self._pins.held if self._known.get(k, (None, 0.0))[1] <= now]:
            self._pins.drop_answer(key)
        if len(self._known) > 100_000:
            self._known = {k: v for k, v in self._known.items() if v[1] > now}

    def _flush(self) -> None:
        """Unpin the released pins on the lookup thread. Called with the lock held."""
        if self._pins.released:
            released = self._pins.take_released()
            if self._thread.submit(self._unpin, released) is None:
                self._unpin(released)

    def _unpin(self, released: list[ChunkPins]) -> None:
        """Best effort: pins on a pool a restarted sidecar forgot are gone with it."""
        self._ranks.unpin(released, BATCH)

    def _arm(self) -> None:
        """Unpin the answers that expire unused even when vLLM runs no step (lookup thread)."""
        if self._closed or not self._pins.held:
            return
        self._thread.arm(self.options.lookup_ttl_s + SWEEP_MARGIN_S, self._sweep)

    def _sweep(self) -> None:
        with self._lock:
            self._expire(time.monotonic())
            released = self._pins.take_released()
        self._unpin(released)
        self._arm()

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """The load shares the pins the chunks' HIT answers hold, until complete_load."""
        try:
            self._pins.start_load(req_context.req_id, keys)
            self._loaded.update(keys)
        except Exception as exc:
            log.warning("hicache prepare_load failed: %s", exc)
        return HiCacheLoadStoreSpec(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Release the pins this load took (only those: another load may share the chunks)."""
        try:
            if self._pins.end_load(req_context.req_id, keys):
                self._flush()
        except Exception as exc:
            log.warning("hicache complete_load failed: %s", exc)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Store the chunks not known to be held already; None while the sidecar is down.
        The sidecar evicts on its own, so no evicted keys are reported."""
        if time.monotonic() < self._down_until:
            return None
        now = time.monotonic()
        todo = [k for k in keys if not ((a := self._known.get(k)) and a[0] is LookupResult.HIT and a[1] > now)]
        if self.residency is not None:  # before the workers store: the sidecar's events then count
            self.residency.track(todo)
        return PrepareStoreOutput(keys_to_store=todo, store_spec=HiCacheLoadStoreSpec(todo), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Forget what was known of the chunks: the next lookup asks the sidecar, which alone
        knows whether the pages were kept (a store it refused still reports success to vLLM)."""
        for key in keys:
            self._known.pop(key, None)
            self._pins.drop_answer(key)
        self._flush()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """What the sidecar stored and removed of vLLM's chunks since the last call, per medium
        (a list: taken now, not while vLLM iterates)."""
        if self.residency is None:
            return []
        try:
            return offloading_events(self.residency.take())
        except Exception as exc:  # never a raise into the scheduler
            log.warning("hicache take_events failed: %s", exc)
            return []

    def loading(self, req_ids: Collection[str]) -> list[bytes]:
        """The chunk keys of the loads prepared for `req_ids` and not completed yet. Called
        with the lock held."""
        return self._pins.loading(req_ids)

    def load_failed(self, keys: Collection[bytes] | None) -> None:
        """A load of `keys` failed (None: of keys not known here). Their answers may be what
        failed: they answer MISS for retry_s instead (every lookup does, for None), so vLLM
        computes those tokens rather than fail again. Called with the lock held."""
        if keys is None:
            self._fail("load", RuntimeError("a worker could not load its blocks"))
            self.reset_cache()
            return
        until = time.monotonic() + self.options.retry_s
        for key in keys:
            self._known[key] = (LookupResult.MISS, until)
            self._unseen.pop(key, None)
            self._pins.drop_answer(key)
        self._flush()

    def reset_cache(self) -> None:
        self._known.clear()
        self._unseen.clear()
        self._pending.clear()
        self._pins.drop_answers()
        self._flush()

    def shutdown(self) -> None:
        self._closed = True
        if self.feed is not None:
            self.feed.close()
        self._thread.shutdown()
        with self._lock:  # what no one will release now: best effort, the pools may be gone
            released = self._pins.take_all()
        self._unpin(released)
        self.client.close()
