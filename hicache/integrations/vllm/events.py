"""What the sidecar holds of vLLM's chunks, as vLLM's own KV events (OffloadingEvent).

The sidecar keeps and evicts pages on its own, so the manager learns of its stores and
removals from the sidecar's KV-event stream (SubscribeEvents, which needs the sidecar's
admin token): a background thread (SidecarEventFeed) follows it and feeds ChunkResidency,
and vLLM's take_events drains what changed since the last drain. Nothing here blocks vLLM's
scheduler or raises into it.

A chunk (one OffloadKey) is held on a tier when every rank's pool of its group holds all of
its blocks_per_chunk pages there: host pool -> Medium.CPU, storage tier (file, Redis) ->
Medium.STORAGE. Page keys are one-way hashes of the chunk key, so only chunks vLLM has
named (a store or a lookup) can be reported; at most MAX_CHUNKS are tracked, and a chunk
forgotten to stay under that is reported removed. Changes are coalesced per chunk and
medium until vLLM drains them: vLLM is told each chunk's net change, never a flap.

When the stream breaks (the sidecar stopped, restarted, or this subscriber fell behind and
lost events) every chunk is reported removed, and a new subscription's snapshot reports the
host pool's chunks again; storage residency comes back as the sidecar reports new writes
or as lookups find chunks in storage.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import Medium, OffloadingEvent

from hicache.api import EventBatch, EventKind, Tier
from hicache.client import HiCacheClient
from hicache.integrations.vllm import rendezvous
from hicache.integrations.vllm.keys import chunk_page_keys, group_of
from hicache.integrations.vllm.options import Options

log = logging.getLogger("hicache.integrations.vllm")
MAX_CHUNKS = 1 << 18  # chunks tracked; about 0.5 KB each with blocks_per_chunk 1
TIERS = (Tier.HOST, Tier.STORAGE)
MEDIUM = {Tier.HOST: Medium.CPU, Tier.STORAGE: Medium.STORAGE}  # the same in vLLM 0.32 and 0.33

# (removed, tier, chunk keys): one of vLLM's OffloadingEvents before its medium is named
Change = tuple[bool, Tier, list[bytes]]


def offloading_events(changes: Iterable[Change]) -> list[OffloadingEvent]:
    """ChunkResidency.take()'s changes as vLLM's OffloadingEvents. A store says its removal
    will be reported (removal_expected), so vLLM keeps the chunk's event payload until then."""
    return [
        OffloadingEvent(keys=keys, medium=MEDIUM[tier], removed=removed, removal_expected=not removed)
        for removed, tier, keys in changes
    ]


class _Chunk:
    """Bit (block * world + rank) of present[tier] is set while that rank's pool holds that
    page of the chunk on tier; reported is the tiers vLLM was told hold it."""

    __slots__ = ("present", "reported")

    def __init__(self) -> None:
        self.present = {Tier.HOST: 0, Tier.STORAGE: 0}
        self.reported: set[Tier] = set()


class ChunkResidency:
    """Which of vLLM's chunks the engine's pools hold, per tier. Thread-safe; every call is
    short and takes only this object's lock.

    Pools are named by the sidecar's pool id; set_pools says which are this engine's, as
    pool id -> (rank, group index)."""

    def __init__(self, blocks_per_chunk: int, world_size: int, max_chunks: int = MAX_CHUNKS):
        if blocks_per_chunk < 1 or world_size < 1 or max_chunks < 1:
            raise ValueError(
                f"blocks_per_chunk {blocks_per_chunk}, world_size {world_size} and max_chunks {max_chunks} must be >= 1"
            )
        self.bpc, self.world, self.max_chunks = blocks_per_chunk, world_size, max_chunks
        self.full = (1 << (blocks_per_chunk * world_size)) - 1
        self._lock = threading.Lock()
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._pages: dict[bytes, tuple[bytes, int]] = {}  # page key -> (chunk key, block)
        self._pools: dict[str, tuple[int, int]] = {}
        self._dirty: dict[bytes, None] = {}
        self._forgotten: list[tuple[bytes, Tier]] = []  # reported, then dropped for room

    def __len__(self) -> int:
        return len(self._chunks)

    def track(self, keys: Iterable[bytes]) -> None:
        """Follow these chunks (vLLM named them): their pages' events count from now on."""
        with self._lock:
            for key in keys:
                key = bytes(key)
                if key in self._chunks:
                    self._chunks.move_to_end(key)
                    continue
                self._chunks[key] = _Chunk()
                for block, page in enumerate(chunk_page_keys(key, self.bpc)):
                    self._pages[page] = (key, block)
            while len(self._chunks) > self.max_chunks:
                self._forget()

    def set_pools(self, pools: dict[str, tuple[int, int]]) -> None:
        """This engine's pools: pool id -> (rank, group index)."""
        for pool_id, (rank, _) in pools.items():
            if not 0 <= rank < self.world:
                raise ValueError(f"pool {pool_id!r}: rank {rank} is outside world size {self.world}")
        with self._lock:
            self._pools = dict(pools)

    def apply(self, kind: EventKind, pool_id: str, tier: Tier, keys: Sequence[bytes]) -> None:
        """A STORED or REMOVED event of the sidecar; events of other pools and of pages of
        chunks not tracked are ignored."""
        if kind not in (EventKind.STORED, EventKind.REMOVED) or tier not in TIERS:
            return
        with self._lock:
            where = self._pools.get(pool_id)
            if where is None:
                return
            rank, group = where
            for page in keys:
                found = self._pages.get(page)
                if found is None or group_of(found[0]) != group:
                    continue
                key, block = found
                self._set(key, tier, 1 << (block * self.world + rank), kind is EventKind.STORED)

    def saw_in_storage(self, pool_id: str, pages: Sequence[bytes]) -> None:
        """A lookup found these pages of a pool in the storage tier (which the event stream's
        snapshot does not list)."""
        self.apply(EventKind.STORED, pool_id, Tier.STORAGE, pages)

    def drop_pool(self, pool_id: str) -> None:
        """The pool is gone (unregistered): nothing it held counts any more."""
        with self._lock:
            where = self._pools.get(pool_id)
            if where is None:
                return
            rank, group = where
            mask = 0
            for block in range(self.bpc):
                mask |= 1 << (block * self.world + rank)
            for key, chunk in self._chunks.items():
                if group_of(key) == group and any(chunk.present[t] & mask for t in TIERS):
                    for t in TIERS:
                        chunk.present[t] &= ~mask
                    self._dirty[key] = None

    def clear(self) -> None:
        """Nothing is known to be held (the event stream broke): every reported chunk goes."""
        with self._lock:
            for key, chunk in self._chunks.items():
                if chunk.reported or any(chunk.present.values()):
                    chunk.present = {Tier.HOST: 0, Tier.STORAGE: 0}
                    self._dirty[key] = None

    def take(self) -> list[Change]:
        """What changed since the last take, per tier: chunks now held (removed False) and
        chunks no longer held (removed True), each chunk's net change only."""
        with self._lock:
            if not self._dirty and not self._forgotten:
                return []
            out: dict[tuple[bool, Tier], list[bytes]] = {}
            for key, tier in self._forgotten:
                out.setdefault((True, tier), []).append(key)
            self._forgotten = []
            for key in self._dirty:
                chunk = self._chunks.get(key)
                if chunk is None:
                    continue
                for tier in TIERS:
                    held = chunk.present[tier] == self.full
                    if held != (tier in chunk.reported):
                        out.setdefault((not held, tier), []).append(key)
                        (chunk.reported.add if held else chunk.reported.discard)(tier)
            self._dirty = {}
        # removals first: a consumer that applies them in order never holds a stale chunk
        return [(removed, tier, keys) for (removed, tier), keys in sorted(out.items(), key=lambda kv: not kv[0][0])]

    def reported(self, tier: Tier) -> list[bytes]:
        """The chunks vLLM was last told are held on `tier`."""
        with self._lock:
            return [k for k, c in self._chunks.items() if tier in c.reported]

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._chunks) <= self.max_chunks, (len(self._chunks), self.max_chunks)
            assert len(self._pages) == len(self._chunks) * self.bpc, (len(self._pages), len(self._chunks))
            for page, (key, block) in self._pages.items():
                assert key in self._chunks and chunk_page_keys(key, self.bpc)[block] == page
            for chunk in self._chunks.values():
                assert all(0 <= chunk.present[t] <= self.full for t in TIERS)

    def _set(self, key: bytes, tier: Tier, bit: int, on: bool) -> None:
        chunk = self._chunks[key]
        before = chunk.present[tier]
        chunk.present[tier] = before | bit if on else before & ~bit
        if chunk.present[tier] != before:
            self._dirty[key] = None

    def _forget(self) -> None:
        key, chunk = self._chunks.popitem(last=False)
        for page in chunk_page_keys(key, self.bpc):
            self._pages.pop(page, None)
        self._dirty.pop(key, None)
        self._forgotten += [(key, tier) for tier in chunk.reported]


class SidecarEventFeed:
    """A daemon thread that follows the sidecar's KV events for this engine's pools (read from
    the workers' rendezvous) into `residency`. It subscribes again, with a snapshot, after
    any break; close() ends it."""

    def __init__(
        self,
        options: Options,
        engine_id: str,
        world_size: int,
        residency: ChunkResidency,
    ):
        if not options.admin_token:
            raise ValueError("the sidecar's KV events need its admin token: set 'admin_token' or $HICACHE_ADMIN_TOKEN")
        self.options, self.engine_id, self.world_size = options, engine_id, world_size
        self.residency = residency
        self.subscriptions = 0  # how many times the stream was opened (tests, logs)
        self._client = HiCacheClient(
            options.target, token=options.token, timeout=options.timeout_s, admin_token=options.admin_token
        )
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._client.close()  # ends a stream the thread is blocked in
        self._thread.join(timeout=self.options.timeout_s)

    def _our_pools(self) -> dict[str, tuple[int, int]] | None:
        pools = rendezvous.read(self.options.meeting_dir, self.engine_id, self.world_size)
        if pools is None:
            return None
        return {pool_id: (rank, group) for rank, ranks in enumerate(pools) for group, (pool_id, _) in ranks.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            ours = self._our_pools()
            if ours is None:  # the workers have not registered yet
                self._stop.wait(0.2)
                continue
            try:
                self._follow(ours)
            except Exception as exc:  # a down sidecar, a refused subscription: never a raise
                if not self._stop.is_set() and not self._warned:
                    log.warning("hicache KV events from %s failed (%s); retrying", self.options.target, exc)
                    self._warned = True
                self._stop.wait(self.options.retry_s)
            self.residency.clear()

    def _follow(self, ours: dict[str, tuple[int, int]]) -> None:
        """Apply the stream's events until it ends or must be opened again: a lost event, or
        this engine's workers registered new pools (a restarted sidecar)."""
        self.residency.set_pools(ours)
        registered: set[str] = set()
        self.subscriptions += 1
        for batch in self._client.events(self.options.namespace, snapshot=True):
            if self._stop.is_set() or batch.dropped:
                return
            self._apply(batch, registered)
            self._warned = False
            if not ours.keys() <= registered:  # a pool of ours is gone: have the workers new ones?
                fresh = self._our_pools()
                if fresh is not None and fresh.keys() != ours.keys() and fresh.keys() <= registered:
                    return

    def _apply(self, batch: EventBatch, registered: set[str]) -> None:
        for event in batch.events:
            pool_id = event.pool.pool_id
            if event.kind is EventKind.POOL_REGISTERED:
                registered.add(pool_id)
            elif event.kind is EventKind.POOL_UNREGISTERED:
                registered.discard(pool_id)
                self.residency.drop_pool(pool_id)
            else:
                self.residency.apply(event.kind, pool_id, event.tier, event.keys)
