"""HiCacheOffloadingManager: vLLM's scheduler-side view of what the sidecar holds.

vLLM asks lookup() one chunk at a time, holding the scheduler. So a chunk the manager has
not seen answers RETRY, and at the end of the step background Lookups on each worker pool
(BATCH page keys per call, see batches) resolve every chunk asked for: HIT when each rank
holds all its pages in host memory, HIT_PENDING (and a Prefetch) when some are in storage
only, MISS otherwise. Answers are reused for lookup_ttl_s. A sidecar that fails a call makes
every lookup a MISS and every store a refusal for retry_s; no call here raises into the
scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
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
from hicache.integrations.vllm import rendezvous
from hicache.integrations.vllm.batches import BATCH, batches
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


class HiCacheOffloadingManager(OffloadingManager):  # type: ignore[misc]
    def __init__(self, options: Options, config: OffloadingConfig, client: HiCacheClient):
        self.options, self.config, self.client = options, config, client
        self.blocks_per_chunk = config.cache.blocks_per_chunk
        self._lock = threading.Lock()
        self._known: dict[bytes, tuple[LookupResult, float]] = {}
        self._pending: dict[bytes, None] = {}
        self._inflight: Future[None] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hicache-lookup")
        self._down_until = 0.0
        self._pools: list[dict[int, tuple[str, str]]] | None = None
        self._pins: Counter[tuple[str, bytes]] = Counter()
        self._events: list[OffloadingEvent] | None = [] if config.enable_kv_cache_events else None

    @property
    def lock(self) -> threading.Lock:
        return self._lock

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
        if self._pending and (self._inflight is None or self._inflight.done()):
            keys, self._pending = list(self._pending), {}
            self._inflight = self._executor.submit(self._resolve, keys)

    def has_pending_work(self) -> bool:
        return bool(self._pending) or (self._inflight is not None and not self._inflight.done())

    def _resolve(self, keys: list[bytes]) -> None:
        """Runs on the lookup thread: ask every rank's pool, then publish under the lock."""
        failed: Exception | None = None
        try:
            answers, ttl = self._ask(keys), self.options.lookup_ttl_s
        except Exception as exc:  # a down sidecar, or anything else: misses, never a raise
            failed, answers, ttl = exc, dict.fromkeys(keys, LookupResult.MISS), self.options.retry_s
        now = time.monotonic()
        with self._lock:
            if failed is not None:
                self._fail("lookup", failed)
            for key, answer in answers.items():
                life = PENDING_TTL_S if answer is LookupResult.HIT_PENDING else ttl
                self._known[key] = (answer, now + life)
            self._expire(now)

    def _ask(self, keys: list[bytes]) -> dict[bytes, LookupResult]:
        bpc = self.blocks_per_chunk
        answers = dict.fromkeys(keys, LookupResult.HIT)
        for group, chunks in _by_group(keys).items():
            page_keys = [k for c in chunks for k in chunk_page_keys(c, bpc)]
            for pool in self._group_pools(group):
                tiers = self._tiers(page_keys, pool)
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
        return answers

    def _tiers(self, page_keys: list[bytes], pool: str) -> list[Tier]:
        """Where `pool` holds each of `page_keys`, asked BATCH keys per Lookup."""
        return [t for part in batches(page_keys, BATCH) for t in self.client.lookup(part, pool=pool).tiers]

    def _group_pools(self, group: int) -> list[str]:
        """Every rank's pool for `group` (read from the workers' rendezvous once all wrote)."""
        if self._pools is None:
            self._pools = rendezvous.read(
                self.options.meeting_dir, self.config.engine_id, self.config.parallel.world_size
            )
            if self._pools is None:
                raise LookupError(f"not every worker of engine {self.config.engine_id!r} has registered its pools yet")
            for ranks in self._pools:
                for pool_id, secret in ranks.values():
                    self.client.attach(pool_id, secret)
        return [ranks[group][0] for ranks in self._pools]

    def _fail(self, what: str, exc: Exception) -> None:
        """Misses for retry_s. Called with the lock held."""
        first = time.monotonic() >= self._down_until
        self._down_until = time.monotonic() + self.options.retry_s
        self._pools = None  # a restarted sidecar gives the workers new pool ids
        if first:
            log.warning("hicache %s failed (%s); misses for %.0f s", what, exc, self.options.retry_s)

    def _expire(self, now: float) -> None:
        if len(self._known) > 100_000:
            self._known = {k: v for k, v in self._known.items() if v[1] > now}

    # ---- loads -------------------------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the chunks' pages on every rank until complete_load."""
        for pool, page_keys in self._pool_keys(keys):
            for part in batches(page_keys, BATCH):
                try:
                    statuses = self.client.pin(part, pool=pool)
                except Exception as exc:
                    self._fail("pin", exc)
                    break
                self._pins.update((pool, k) for k, s in zip(part, statuses, strict=True) if s is KeyStatus.PINNED)
        return HiCacheLoadStoreSpec(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for pool, page_keys in self._pool_keys(keys):
            pinned = [k for k in page_keys if self._pins[(pool, k)] > 0]
            for k in pinned:
                self._pins[(pool, k)] -= 1
                if not self._pins[(pool, k)]:
                    del self._pins[(pool, k)]
            for part in batches(pinned, BATCH):
                try:
                    self.client.unpin(part, pool=pool)
                except Exception as exc:
                    self._fail("unpin", exc)
                    break

    def _pool_keys(self, keys: Collection[bytes]) -> list[tuple[str, list[bytes]]]:
        out = []
        for group, chunks in _by_group(list(keys)).items():
            page_keys = [k for c in chunks for k in chunk_page_keys(c, self.blocks_per_chunk)]
            try:
                pools = self._group_pools(group)
            except LookupError:
                continue
            out += [(pool, page_keys) for pool in pools]
        return out

    # ---- stores ------------------------------------------------------------------------------
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Store the chunks not known to be held already; None while the sidecar is down.
        The sidecar evicts on its own, so no evicted keys are reported."""
        if time.monotonic() < self._down_until:
            return None
        now = time.monotonic()
        todo = [k for k in keys if not ((a := self._known.get(k)) and a[0] is LookupResult.HIT and a[1] > now)]
        return PrepareStoreOutput(keys_to_store=todo, store_spec=HiCacheLoadStoreSpec(todo), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Forget what was known of the chunks: the next lookup asks the sidecar, which alone
        knows whether the pages were kept (a store it refused still reports success to vLLM)."""
        for key in keys:
            self._known.pop(key, None)
        if success and self._events is not None and keys:
            self._events.append(OffloadingEvent(keys=list(keys), medium=Medium.CPU, removed=False))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def reset_cache(self) -> None:
        self._known.clear()
        self._pending.clear()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.client.close()


def _by_group(keys: list[bytes]) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {}
    for key in keys:
        out.setdefault(group_of(key), []).append(key)
    return out
