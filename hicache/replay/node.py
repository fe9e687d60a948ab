"""One replaying engine: a client and a CPU device pool against one sidecar, serving its
share of a trace's requests as an engine would, and checking every page it reloads.

Per request: Lookup its blocks' keys; Reload the hit prefix and compare every page with the
bytes its key stands for; write the missed blocks' pages (the "prefill") and Offload them.
A prefix longer than half the host tier is reloaded in parts of that size, as an engine
with a small host tier must (storage pages are fetched into host pages before the copy).
A page's bytes are a function of its key, so any page served under the wrong key, or torn,
is caught.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient
from hicache.geometry import KVGeometry
from hicache.pools import DeviceKVPool
from hicache.replay.trace import Request

STORED_ANSWERS = {
    KeyStatus.STORED: "stored",
    KeyStatus.DEDUPLICATED: "deduplicated",
    KeyStatus.NO_SPACE: "no_space",
}


@dataclass
class NodeResult:
    """What one node saw (summed over its requests)."""

    requests: int = 0
    input_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"host": 0, "storage": 0})
    pages_reloaded: int = 0
    pages_offloaded: int = 0
    offload_answers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STORED_ANSWERS.values(), 0))
    pages_checked: int = 0
    corrupt_pages: int = 0
    lookup_reload_gaps: int = 0  # prefixes Lookup reported that Reload then served shorter
    latencies_s: list[float] = field(default_factory=list)


def page_content(key: bytes, page_bytes: int) -> bytes:
    """The bytes a page stands for under `key`."""
    seed = hashlib.sha256(key).digest()
    return (seed * (page_bytes // len(seed) + 1))[:page_bytes]


class ReplayNode:
    """Serves requests through the sidecar at `target`. Not thread-safe: one thread each."""

    def __init__(self, target: str, geometry: KVGeometry, device_pages: int, *, model_id: str, namespace: str = ""):
        self.geometry = geometry
        self.device = DeviceKVPool(geometry, device_pages)
        self.client = HiCacheClient(target, timeout=120)
        self.pool = self.client.register(self.device, model_id=model_id, namespace=namespace)
        self.reload_part = max(1, self.client.stats()[0].host_pages // 2)
        self.result = NodeResult()
        self._stop = threading.Event()

    def keys(self, req: Request) -> list[bytes]:
        """Chained page keys of the request's blocks (a block: page_size tokens standing for it)."""
        ps = self.geometry.page_size
        tokens = np.repeat(np.asarray(req.blocks, dtype=np.int64) % (1 << 31), ps)
        return self.client.page_keys(tokens)

    def serve(self, requests: Sequence[Request], start: float, speed: float) -> None:
        """Serve `requests` in order; with speed > 0, request i not before start +
        timestamp / speed (seconds from the trace's milliseconds)."""
        for req in requests:
            if self._stop.is_set():
                return
            if speed > 0:
                wait = start + req.timestamp_ms / 1000.0 / speed - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            self.serve_one(req)

    def serve_one(self, req: Request) -> None:
        r, pb = self.result, self.geometry.page_bytes
        keys = self.keys(req)
        if len(keys) > self.device.num_pages:
            raise ValueError(
                f"a request of {len(keys)} pages does not fit the {self.device.num_pages}-page device pool"
            )
        t0 = time.perf_counter()
        tiers = self.client.lookup(keys).tiers
        found = next((i for i, t in enumerate(tiers) if t == Tier.NONE), len(keys))
        loaded = 0
        from_storage = 0
        while loaded < found:
            part = min(found, loaded + self.reload_part)
            statuses = self.client.reload(keys[loaded:part], list(range(loaded, part))).statuses
            for s in statuses:
                if s not in (KeyStatus.LOADED, KeyStatus.LOADED_FROM_STORAGE):
                    break
                loaded += 1
                from_storage += s == KeyStatus.LOADED_FROM_STORAGE
            if loaded < part:
                r.lookup_reload_gaps += 1
                break
        for p in range(loaded):
            r.pages_checked += 1
            if bytes(self.device.read_page(p).numpy()) != page_content(keys[p], pb):
                r.corrupt_pages += 1
        for p in range(loaded, len(keys)):  # the prefill of the missed blocks
            self.device.write_page(p, page_content(keys[p], pb))
        if loaded < len(keys):
            statuses = self.client.offload(keys[loaded:], list(range(loaded, len(keys)))).statuses
            for s in statuses:
                r.offload_answers[STORED_ANSWERS[s]] += 1
        r.latencies_s.append(time.perf_counter() - t0)
        tokens = req.hit_tokens(loaded)
        storage_tokens = min(tokens, from_storage * req.block_tokens)
        r.hit_tokens["storage"] += storage_tokens
        r.hit_tokens["host"] += tokens - storage_tokens
        r.requests += 1
        r.input_tokens += req.input_tokens
        r.pages_reloaded += loaded
        r.pages_offloaded += len(keys) - loaded

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.client.close()
        self.device.close()
