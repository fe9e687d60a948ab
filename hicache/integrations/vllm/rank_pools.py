"""RankPools: the vLLM manager's calls to the sidecar, one per rank pool, on its lookup thread.

A chunk's pages sit in every rank's pool for the chunk's KV-cache group. The pool ids come
from the workers' rendezvous, read once every worker wrote. ask() looks each chunk up on
every rank: a chunk whose pages some rank lacks is a MISS; pages only in storage are
prefetched, waiting up to the sidecar's prefetch timeout (policy "timeout": this thread is
not vLLM's scheduler), and a chunk not all on host after that is a MISS; the pages of the
remaining HITs are pinned on every rank. Every call carries at most `batch` page keys.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.config import OffloadingConfig

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient
from hicache.integrations.vllm import rendezvous
from hicache.integrations.vllm.batches import batches
from hicache.integrations.vllm.events import ChunkResidency
from hicache.integrations.vllm.keys import chunk_page_keys, group_of
from hicache.integrations.vllm.options import Options
from hicache.integrations.vllm.pin_ledger import ChunkPins

log = logging.getLogger("hicache.integrations.vllm")


class RankPools:
    def __init__(
        self, options: Options, config: OffloadingConfig, client: HiCacheClient, residency: ChunkResidency | None
    ):
        self.options, self.config, self.client, self.residency = options, config, client, residency
        self.blocks_per_chunk = config.cache.blocks_per_chunk
        self.pools: list[dict[int, tuple[str, str]]] | None = None  # None: read the rendezvous again

    def ask(self, keys: list[bytes], pins: dict[bytes, ChunkPins], batch: int) -> dict[bytes, LookupResult]:
        """Each chunk's answer. The pages of each HIT are pinned on every rank first, recorded
        in `pins` as they are taken (a chunk whose pin fails is a MISS)."""
        bpc = self.blocks_per_chunk
        answers = dict.fromkeys(keys, LookupResult.HIT)
        for group, chunks in _by_group(keys).items():
            page_keys = [k for c in chunks for k in chunk_page_keys(c, bpc)]
            pools = self.group_pools(group)
            for pool in pools:
                tiers = self.tiers(page_keys, pool, batch)
                if self.residency is not None:
                    stored = [k for k, t in zip(page_keys, tiers, strict=True) if t is Tier.STORAGE]
                    self.residency.saw_in_storage(pool, stored)
                wanted: dict[bytes, list[bytes]] = {}  # chunk -> its pages only in storage
                for i, chunk in enumerate(chunks):
                    span = slice(i * bpc, (i + 1) * bpc)
                    if answers[chunk] is not LookupResult.HIT:  # a MISS on another rank already
                        continue
                    if Tier.NONE in tiers[span]:
                        answers[chunk] = LookupResult.MISS
                    elif only := [k for k, t in zip(page_keys[span], tiers[span], strict=True) if t is Tier.STORAGE]:
                        wanted[chunk] = only
                arrived = self.prefetch([k for ks in wanted.values() for k in ks], pool, batch)
                for chunk, only in wanted.items():
                    if not arrived.issuperset(only):
                        answers[chunk] = LookupResult.MISS
            hits = [c for c in chunks if answers[c] is LookupResult.HIT]
            hit_pages = [k for c in hits for k in chunk_page_keys(c, bpc)]
            for chunk in hits:
                pins[chunk] = ChunkPins([])
            for pool in pools:
                statuses: list[KeyStatus] = []
                try:
                    for part in batches(hit_pages, batch):
                        statuses += self.client.pin(part, pool=pool)
                finally:  # record what got pinned, even when a later batch failed
                    for i, chunk in enumerate(hits):
                        got = zip(hit_pages[i * bpc : (i + 1) * bpc], statuses[i * bpc : (i + 1) * bpc], strict=False)
                        pinned = [k for k, s in got if s is KeyStatus.PINNED]
                        pins[chunk].pages.append((pool, pinned))
                        if len(pinned) < bpc:  # evicted since the Lookup: never a HIT without its pins
                            answers[chunk] = LookupResult.MISS
        return answers

    def prefetch(self, keys: list[bytes], pool: str, batch: int) -> set[bytes]:
        """Storage -> host for `keys` on `pool`, each call waiting up to the sidecar's prefetch
        timeout: the keys on host after it (a key it did not bring in time is cancelled)."""
        arrived: set[bytes] = set()
        for part in batches(keys, batch):
            statuses = self.client.prefetch(part, policy="timeout", pool=pool).statuses
            arrived.update(
                k for k, s in zip(part, statuses, strict=True) if s in (KeyStatus.RESIDENT, KeyStatus.FETCHED)
            )
        return arrived

    def tiers(self, page_keys: list[bytes], pool: str, batch: int) -> list[Tier]:
        """Where `pool` holds each of `page_keys`, asked `batch` keys per Lookup."""
        return [t for part in batches(page_keys, batch) for t in self.client.lookup(part, pool=pool).tiers]

    def group_pools(self, group: int) -> list[str]:
        """Every rank's pool for `group` (read from the workers' rendezvous once all wrote).
        Lookup thread only; the manager may reset self.pools meanwhile, so it is read once.
        Raises LookupError while some worker has not registered its pools."""
        pools = self.pools
        if pools is None:
            pools = rendezvous.read(self.options.meeting_dir, self.config.engine_id, self.config.parallel.world_size)
            if pools is None:
                raise LookupError(f"not every worker of engine {self.config.engine_id!r} has registered its pools yet")
            for ranks in pools:
                for pool_id, secret in ranks.values():
                    self.client.attach(pool_id, secret)
            self.pools = pools
        return [ranks[group][0] for ranks in pools]

    def unpin(self, released: list[ChunkPins], batch: int) -> None:
        """Best effort: pins on a pool a restarted sidecar forgot are gone with it."""
        for pins in released:
            for pool, keys in pins.pages:
                for part in batches(keys, batch):
                    try:
                        self.client.unpin(part, pool=pool)
                    except Exception as exc:
                        log.debug("hicache unpin on pool %s failed: %s", pool, exc)
                        break


def _by_group(keys: list[bytes]) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {}
    for key in keys:
        out.setdefault(group_of(key), []).append(key)
    return out
