"""The demo's example engine: serves prefill requests over CPU device pools (one per KV
group, registered with the sidecar), reusing every cached page it can find.

Per request: pages already in its own device cache are used in place; the sidecar is
asked (Lookup) for the next ones; those in the storage tier are prefetched to host; all
found are reloaded layer-wise while the model starts on layer 0; the rest is computed and
its new full pages are offloaded. Then it checks itself: every reloaded page against the
digest taken when the page was computed, and every page and every attention output
against a recomputation of the whole request from scratch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient, ReloadHandle
from hicache.demo.device_cache import DeviceCache
from hicache.demo.model import Layer, ToyModel
from hicache.demo.report import Tally
from hicache.memory import local_buffer
from hicache.pools import DeviceKVPool

LOADED = {KeyStatus.LOADED, KeyStatus.LOADED_FROM_STORAGE}


def page_digest(pool: DeviceKVPool, page: int) -> bytes:
    return hashlib.blake2b(pool.read_page(page).numpy().tobytes(), digest_size=16).digest()


class DemoEngine:
    """pools and pool_ids are keyed by group; every group shares page ids and page keys."""

    def __init__(
        self,
        client: HiCacheClient,
        pools: dict[str, DeviceKVPool],
        pool_ids: dict[str, str],
        model: ToyModel,
        tally: Tally,
        *,
        max_request_pages: int,
        ledger: dict[tuple[str, bytes], bytes] | None = None,
    ):
        """`ledger`: (group, key) -> digest of every page computed, shared by the engines of a
        multi-node run so that one node checks the pages another node computed."""
        sizes = {p.num_pages for p in pools.values()}
        if len(sizes) != 1:
            raise ValueError(f"every group's device pool must have the same page count, got {sizes}")
        self.client, self.pools, self.pool_ids, self.model, self.tally = client, pools, pool_ids, model, tally
        self.page_size = model.page_size
        self.cache = DeviceCache(sizes.pop())
        if max_request_pages > self.cache.num_pages:
            raise ValueError(
                f"a request of {max_request_pages} pages does not fit a device pool of {self.cache.num_pages} pages"
            )
        self.ledger = {} if ledger is None else ledger
        self.written: set[bytes] = set()  # keys this engine offloaded: a storage hit of another is cross-node
        self.scratch = {
            name: DeviceKVPool(
                p.geometry, max_request_pages, memory=local_buffer(p.geometry.pool_bytes(max_request_pages))
            )
            for name, p in pools.items()
        }

    def close(self) -> None:
        for pool in self.scratch.values():
            pool.close()

    # ---- one request ----------------------------------------------------------------------
    def serve(self, tokens: np.ndarray) -> None:
        t, ps = self.tally, self.page_size
        full = next(iter(self.pool_ids.values()))
        if len(tokens) == 0:
            raise ValueError("a request needs at least one token")
        keys = self.client.page_keys(tokens, pool=full)
        usable = keys[: (len(tokens) - 1) // ps]  # the last token is always computed (it yields the logits)
        n_pages = -(-len(tokens) // ps)
        n_dev = self.cache.prefix_length(usable)
        dev_pages = self.cache.acquire(usable[:n_dev])
        scratch = self.cache.allocate(n_pages - n_dev)
        if scratch is None:
            raise ValueError(f"device pool of {self.cache.num_pages} pages cannot hold a request of {n_pages} pages")
        pages = dev_pages + scratch
        hit_keys, tiers = self._find(usable[n_dev:])
        handles = self._reload(hit_keys, scratch[: len(hit_keys)])
        n_loaded = self._loaded_prefix(handles, len(hit_keys))
        if n_loaded < len(hit_keys):  # pages past the prefix get computed: let their copies finish first
            for h in handles.values():
                h.wait()
        cached = n_dev + n_loaded
        for i in range(n_dev, cached):
            self.cache.insert(keys[i], pages[i])

        def before_layer(layer: Layer) -> None:
            if layer.group in handles:
                handles[layer.group].wait_layer(layer.local)

        x = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        outputs = self.model.prefill(self.pools, pages, x, cached * ps, before_layer)
        for h in handles.values():
            h.wait()
        self._verify_reloaded(keys[n_dev:cached], pages[n_dev:cached])
        self._verify_recompute(pages, x, cached * ps, outputs)
        self._offload(keys, pages, cached)
        self.cache.release(pages)
        t.requests += 1
        t.tokens += len(tokens)
        t.device_tokens += n_dev * ps
        for key, tier in zip(hit_keys[:n_loaded], tiers[:n_loaded], strict=True):
            if tier == Tier.STORAGE:
                t.storage_tokens += ps
                t.cross_node_tokens += ps if key not in self.written else 0
            else:
                t.host_tokens += ps
        t.computed_tokens += len(tokens) - cached * ps
        t.device_evictions = self.cache.evictions
        self.cache.check_integrity()

    def _find(self, keys: list[bytes]) -> tuple[list[bytes], list[Tier]]:
        """The leading keys the sidecar holds for every group, with their tier; prefetches
        the ones only in storage."""
        if not keys:
            return [], []
        found = {g: self.tally.timed("Lookup", self.client.lookup, keys, pool=pid) for g, pid in self.pool_ids.items()}
        tiers: list[Tier] = []
        for i in range(len(keys)):
            per_group = [r.tiers[i] for r in found.values()]
            if Tier.NONE in per_group:
                break
            tiers.append(Tier.STORAGE if Tier.STORAGE in per_group else Tier.HOST)
        hit = keys[: len(tiers)]
        for g, pid in self.pool_ids.items():
            stored = [k for k, tier in zip(hit, found[g].tiers, strict=False) if tier == Tier.STORAGE]
            if stored:
                r = self.tally.timed("Prefetch", self.client.prefetch, stored, policy="wait_complete", pool=pid)
                fetched = r.statuses.count(KeyStatus.FETCHED)
                self.tally.pages_prefetched += fetched
                self.tally.prefetch_bytes += fetched * self.pools[g].geometry.page_bytes
        return hit, tiers

    def _reload(self, keys: list[bytes], pages: list[int]) -> dict[str, ReloadHandle]:
        if not keys:
            return {}
        return {
            g: self.tally.timed("Reload", self.client.reload, keys, pages, layerwise=True, pool=pid)
            for g, pid in self.pool_ids.items()
        }

    def _loaded_prefix(self, handles: dict[str, ReloadHandle], n: int) -> int:
        loaded = 0
        while loaded < n and all(h.statuses[loaded] in LOADED for h in handles.values()):
            loaded += 1
        self.tally.reload_misses += n - loaded
        for h in handles.values():
            self.tally.reload_bytes += h.bytes_copied
        self.tally.pages_reloaded += loaded * len(handles)
        return loaded

    # ---- checks -------------------------------------------------------------------------------
    def _verify_reloaded(self, keys: Sequence[bytes], pages: Sequence[int]) -> None:
        for name, pool in self.pools.items():
            for key, page in zip(keys, pages, strict=True):
                want = self.ledger.get((name, key))
                if want is None:  # computed by an engine of another process: checked by recomputation
                    continue
                self.tally.pages_verified += 1
                if want != page_digest(pool, page):
                    self.tally.page_mismatches += 1

    def _verify_recompute(self, pages: list[int], x: torch.Tensor, start: int, outputs: list[torch.Tensor]) -> None:
        """Recompute the whole request in private pools; compare outputs and every full page."""
        t = self.tally
        ref = self.model.prefill(self.scratch, list(range(len(pages))), x, 0)
        for got, want in zip(outputs, ref, strict=True):
            t.attention_checked += 1
            t.attention_mismatches += not torch.equal(got, want[start:])
        for name, pool in self.pools.items():
            for i in range(len(x) // self.page_size):
                t.pages_recomputed_checked += 1
                t.recompute_mismatches += not torch.equal(pool.read_page(pages[i]), self.scratch[name].read_page(i))

    # ---- offload ------------------------------------------------------------------------------
    def _offload(self, keys: list[bytes], pages: list[int], cached: int) -> None:
        """Insert the newly computed full pages into the device cache and offload them."""
        new_keys, new_pages = [], []
        for i in range(cached, len(keys)):
            if keys[i] in self.cache:  # an orphan from an earlier request: keep that copy
                continue
            self.cache.insert(keys[i], pages[i])
            new_keys.append(keys[i])
            new_pages.append(pages[i])
            self.written.add(keys[i])
            for name, pool in self.pools.items():
                digest = page_digest(pool, pages[i])
                if self.ledger.setdefault((name, keys[i]), digest) != digest:  # computed before: same bits
                    self.tally.recompute_mismatches += 1
        if not new_keys:
            return
        for pid in self.pool_ids.values():
            r = self.tally.timed("Offload", self.client.offload, new_keys, new_pages, pool=pid)
            self.tally.offload_bytes += r.bytes_copied
            self.tally.no_space += r.statuses.count(KeyStatus.NO_SPACE)
        self.tally.pages_offloaded += len(new_keys) * len(self.pools)
