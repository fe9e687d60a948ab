"""HiCacheOffloadingManager: vLLM's scheduler-side view of what the sidecar holds.

vLLM asks lookup() one chunk at a time, holding the scheduler. So a chunk the manager has
not seen answers RETRY, and at the end of the step background Lookups on each worker pool
(BATCH page keys per call, see batches) resolve every chunk asked for: HIT when each rank
holds all its pages in host memory, HIT_PENDING (and a Prefetch) when some are in storage
only, MISS otherwise. Answers are reused for lookup_ttl_s.

vLLM's own connector cannot take a failed load (its OffloadingConnectorWorker asserts on it, which
kills the worker), so a HIT must stay loadable: the lookup thread pins a chunk's pages on
every rank before it answers HIT (a chunk whose pin fails is a MISS), a load shares those
pins until complete_load, and they are released (off the scheduler thread) once the answer
has expired and no load holds them. A sidecar that fails a call makes every lookup a MISS
and every store a refusal for retry_s; no call here raises into the scheduler.

The lookup thread and vLLM's scheduler share the manager's state under `lock` (re-entrant):
vLLM 0.33 holds it around its calls, and on 0.32 each entry point takes it (compat).

With vLLM's KV events on (--kv-events-config), take_events reports what the sidecar holds of
the chunks vLLM stored or looked up: stores and removals, host pool as Medium.CPU and
storage tier as Medium.STORAGE, from the sidecar's own event stream (events.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
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

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient
from hicache.integrations.vllm import compat, rendezvous
from hicache.integrations.vllm.batches import BATCH, batches
from hicache.integrations.vllm.events import ChunkResidency, SidecarEventFeed, offloading_events
from hicache.integrations.vllm.keys import chunk_page_keys, group_of
from hicache.integrations.vllm.options import Options

log = logging.getLogger("hicache.integrations.vllm")
PENDING_TTL_S = 0.05  # a chunk being prefetched is asked about again this soon


class HiCacheLoadStoreSpec(LoadStoreSpec):  # type: ignore[misc]
    """The chunks of one load or store, by OffloadKey, in vLLM's group order."""

    def __init__(self, keys: Iterable[bytes]):
        self.keys = [bytes(k) for k in keys]

    def __repr__(self) -> str:
        return f"HiCacheLoadStoreSpec({len(self.keys)} chunks)"


class _Pins:
    """The pins the lookup thread took on one chunk's pages, per rank pool. Held by the chunk's
    HIT answer and by each load of the chunk; unpinned once no holder is left."""

    __slots__ = ("holders", "pages")

    def __init__(self, pages: list[tuple[str, list[bytes]]]):
        self.pages, self.holders = pages, 1


# vLLM's calls into the manager that touch its state (not shutdown, which takes the lock itself)
ENTRY_POINTS = (
    "lookup",
    "on_schedule_end",
    "has_pending_work",
    "prepare_load",
    "complete_load",
    "prepare_store",
    "complete_store",
    "take_events",
    "reset_cache",
)


@compat.locked_entry_points(ENTRY_POINTS)
class HiCacheOffloadingManager(OffloadingManager):  # type: ignore[misc]
    def __init__(self, options: Options, config: OffloadingConfig, client: HiCacheClient):
        self.options, self.config, self.client = options, config, client
        self.blocks_per_chunk = config.cache.blocks_per_chunk
        self._lock = threading.RLock()  # vLLM's calls hold it (see compat); the lookup thread takes it too
        self._known: dict[bytes, tuple[LookupResult, float]] = {}
        self._held: dict[bytes, _Pins] = {}  # the pins behind each HIT answer in _known
        self._loads: dict[tuple[str, tuple[bytes, ...]], list[list[_Pins]]] = {}  # (req id, keys) -> pins
        self._released: list[_Pins] = []  # no holder left: to unpin on the lookup thread
        self._pending: dict[bytes, None] = {}
        self._inflight: Future[None] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hicache-lookup")
        self._timer: threading.Timer | None = None
        self._closed = False
        self._down_until = 0.0
        self._failing = False  # since the last lookup that succeeded (the failure was logged)
        self._pools: list[dict[int, tuple[str, str]]] | None = None
        self.residency: ChunkResidency | None = None  # with vLLM's KV events on: what the sidecar holds
        self.feed: SidecarEventFeed | None = None
        if config.enable_kv_cache_events:
            self._follow_events()

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
        with_holders = {id(p): p for p in self._held.values()}
        with_holders.update((id(p), p) for loads in self._loads.values() for pins in loads for p in pins)
        return sum(len(keys) for p in [*with_holders.values(), *self._released] for _, keys in p.pages)

    # ---- lookups -------------------------------------------------------------------------------
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
        self._expire(time.monotonic())
        if self._pending and (self._inflight is None or self._inflight.done()):
            keys, self._pending = list(self._pending), {}
            self._inflight = self._submit(self._resolve, keys)
        self._flush()

    def has_pending_work(self) -> bool:
        return bool(self._pending) or (self._inflight is not None and not self._inflight.done())

    def _resolve(self, keys: list[bytes]) -> None:
        """Runs on the lookup thread: ask every rank's pool, pin the hits, then publish under
        the lock."""
        failed: Exception | None = None
        pins: dict[bytes, _Pins] = {}
        if self.residency is not None:  # before the sidecar is asked: its events count from now
            self.residency.track(keys)
        try:
            answers, ttl = self._ask(keys, pins), self.options.lookup_ttl_s
        except Exception as exc:  # a down sidecar, or anything else: misses, never a raise
            failed, answers, ttl = exc, dict.fromkeys(keys, LookupResult.MISS), self.options.retry_s
        now = time.monotonic()
        with self._lock:
            if failed is not None:
                self._fail("lookup", failed)
            else:
                self._failing = False
            for key, answer in answers.items():
                old = self._held.pop(key, None)  # an expired answer asked again: its pins go
                if old is not None:
                    self._drop(old)
                life = PENDING_TTL_S if answer is LookupResult.HIT_PENDING else ttl
                self._known[key] = (answer, now + life)
                if answer is LookupResult.HIT:
                    self._held[key] = pins.pop(key)
            self._released += pins.values()  # the pins of chunks that are not HITs
            self._expire(now)
            released, self._released = self._released, []
        self._unpin(released)
        self._arm()

    def _ask(self, keys: list[bytes], pins: dict[bytes, _Pins]) -> dict[bytes, LookupResult]:
        """Each chunk's answer. The pages of each HIT are pinned on every rank first, recorded
        in `pins` as they are taken (a chunk whose pin fails is a MISS)."""
        bpc = self.blocks_per_chunk
        answers = dict.fromkeys(keys, LookupResult.HIT)
        for group, chunks in _by_group(keys).items():
            page_keys = [k for c in chunks for k in chunk_page_keys(c, bpc)]
            pools = self._group_pools(group)
            for pool in pools:
                tiers = self._tiers(page_keys, pool)
                if self.residency is not None:
                    stored = [k for k, t in zip(page_keys, tiers, strict=True) if t is Tier.STORAGE]
                    self.residency.saw_in_storage(pool, stored)
                fetch: list[bytes] = []
                for i, chunk in enumerate(chunks):
                    mine = tiers[i * bpc : (i + 1) * bpc]
                    if Tier.NONE in mine:
                        answers[chunk] = LookupResult.MISS
                    elif Tier.STORAGE in mine:
                        fetch += page_keys[i * bpc : (i + 1) * bpc]
                        if answers[chunk] is LookupResult.HIT:
                            answers[chunk] = LookupResult.HIT_PENDING
                for part in batches(fetch, BATCH):
                    self.client.prefetch(part, policy="best_effort", pool=pool)
            hits = [c for c in chunks if answers[c] is LookupResult.HIT]
            hit_pages = [k for c in hits for k in chunk_page_keys(c, bpc)]
            for chunk in hits:
                pins[chunk] = _Pins([])
            for pool in pools:
                statuses: list[KeyStatus] = []
                try:
                    for part in batches(hit_pages, BATCH):
                        statuses += self.client.pin(part, pool=pool)
                finally:  # record what got pinned, even when a later batch failed
                    for i, chunk in enumerate(hits):
                        got = zip(hit_pages[i * bpc : (i + 1) * bpc], statuses[i * bpc : (i + 1) * bpc], strict=False)
                        pinned = [k for k, s in got if s is KeyStatus.PINNED]
                        pins[chunk].pages.append((pool, pinned))
                        if len(pinned) < bpc:  # evicted since the Lookup: never a HIT without its pins
                            answers[chunk] = LookupResult.MISS
        return answers

    def _tiers(self, page_keys: list[bytes], pool: str) -> list[Tier]:
        """Where `pool` holds each of `page_keys`, asked BATCH keys per Lookup."""
        return [t for part in batches(page_keys, BATCH) for t in self.client.lookup(part, pool=pool).tiers]

    def _group_pools(self, group: int) -> list[str]:
        """Every rank's pool for `group` (read from the workers' rendezvous once all wrote).
        Lookup thread only; _fail may reset self._pools meanwhile, so it is read once."""
        pools = self._pools
        if pools is None:
            pools = rendezvous.read(self.options.meeting_dir, self.config.engine_id, self.config.parallel.world_size)
            if pools is None:
                raise LookupError(f"not every worker of engine {self.config.engine_id!r} has registered its pools yet")
            for ranks in pools:
                for pool_id, secret in ranks.values():
                    self.client.attach(pool_id, secret)
            self._pools = pools
        return [ranks[group][0] for ranks in pools]

    def _fail(self, what: str, exc: Exception) -> None:
        """Misses for retry_s. Called with the lock held. An outage is logged once (until a
        lookup succeeds again); workers that are not registered (LookupError) said why themselves."""
        self._down_until = time.monotonic() + self.options.retry_s
        self._pools = None  # a restarted sidecar gives the workers new pool ids
        if self._failing or isinstance(exc, LookupError):
            log.debug("hicache %s failed (%s); misses for %.0f s", what, exc, self.options.retry_s)
        else:
            log.warning(
                "hicache %s failed (%s); misses until it answers (asked every %.0f s)", what, exc, self.options.retry_s
            )
        self._failing = True

    def _expire(self, now: float) -> None:
        """Drop the pins of expired HIT answers. Called with the lock held."""
        for key in [k for k in self._held if self._known.get(k, (None, 0.0))[1] <= now]:
            self._drop(self._held.pop(key))
        if len(self._known) > 100_000:
            self._known = {k: v for k, v in self._known.items() if v[1] > now}

    # ---- pins ----------------------------------------------------------------------------------
    def _drop(self, pins: _Pins) -> None:
        """One holder of `pins` is done. Called with the lock held; _flush unpins."""
        pins.holders -= 1
        if pins.holders == 0:
            self._released.append(pins)

    def _flush(self) -> None:
        """Unpin the released pins on the lookup thread. Called with the lock held."""
        if self._released:
            released, self._released = self._released, []
            if self._submit(self._unpin, released) is None:
                self._unpin(released)

    def _unpin(self, released: list[_Pins]) -> None:
        """Best effort: pins on a pool a restarted sidecar forgot are gone with it."""
        for pins in released:
            for pool, keys in pins.pages:
                for part in batches(keys, BATCH):
                    try:
                        self.client.unpin(part, pool=pool)
                    except Exception as exc:
                        log.debug("hicache unpin on pool %s failed: %s", pool, exc)
                        break

    def _submit(self, fn: Any, *args: Any) -> Future[None] | None:
        """fn(*args) on the lookup thread; None once shut down."""
        try:
            return self._executor.submit(fn, *args)
        except RuntimeError:  # shut down
            return None

    def _arm(self) -> None:
        """Unpin the answers that expire unused even when vLLM runs no step (lookup thread)."""
        if self._closed or not self._held or (self._timer is not None and self._timer.is_alive()):
            return
        self._timer = threading.Timer(self.options.lookup_ttl_s + PENDING_TTL_S, self._submit, (self._sweep,))
        self._timer.daemon = True
        self._timer.start()

    def _sweep(self) -> None:
        with self._lock:
            self._expire(time.monotonic())
            released, self._released = self._released, []
        self._unpin(released)
        self._arm()

    # ---- loads -------------------------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """The load shares the pins the chunks' HIT answers hold, until complete_load."""
        try:
            taken: list[_Pins] = []
            for key in keys:
                pins = self._held.get(key)
                if pins is None:  # vLLM loads only chunks answered HIT in this step: not expected
                    log.error("hicache: vLLM loads chunk %s that holds no pins; the load may fail", bytes(key).hex())
                    continue
                pins.holders += 1
                taken.append(pins)
            self._loads.setdefault((req_context.req_id, tuple(keys)), []).append(taken)
        except Exception as exc:
            log.warning("hicache prepare_load failed: %s", exc)
        return HiCacheLoadStoreSpec(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Release the pins this load took (only those: another load may share the chunks)."""
        try:
            key = (req_context.req_id, tuple(keys))
            loads = self._loads.get(key)
            if not loads:
                return
            for pins in loads.pop(0):
                self._drop(pins)
            if not loads:
                del self._loads[key]
            self._flush()
        except Exception as exc:
            log.warning("hicache complete_load failed: %s", exc)

    # ---- stores ------------------------------------------------------------------------------
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
            pins = self._held.pop(key, None)
            if pins is not None:
                self._drop(pins)
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
        return [k for (rid, keys) in self._loads for k in keys if rid in req_ids]

    def load_failed(self, keys: Collection[bytes] | None) -> None:
        """A load of `keys` failed (None: of keys not known here). Their answers, reused for
        lookup_ttl_s, may be what failed: they answer MISS for retry_s instead (every lookup
        does, for None), so vLLM computes those tokens rather than load them again and fail
        again. Called with the lock held."""
        if keys is None:
            self._fail("load", RuntimeError("a worker could not load its blocks"))
            self.reset_cache()
            return
        until = time.monotonic() + self.options.retry_s
        for key in keys:
            self._known[key] = (LookupResult.MISS, until)
            pins = self._held.pop(key, None)
            if pins is not None:
                self._drop(pins)
        self._flush()

    def reset_cache(self) -> None:
        self._known.clear()
        self._pending.clear()
        for pins in self._held.values():
            self._drop(pins)
        self._held.clear()
        self._flush()

    def shutdown(self) -> None:
        self._closed = True
        if self.feed is not None:
            self.feed.close()
        if self._timer is not None:
            self._timer.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # what no one will release now: best effort, the pools may be gone
            held = {id(p): p for p in self._held.values()}
            held.update((id(p), p) for loads in self._loads.values() for pins in loads for p in pins)
            released = [*self._released, *held.values()]
            self._held.clear()
            self._loads.clear()
            self._released.clear()
        self._unpin(released)
        self.client.close()


def _by_group(keys: list[bytes]) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {}
    for key in keys:
        out.setdefault(group_of(key), []).append(key)
    return out
