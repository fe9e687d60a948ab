"""The engines of benchmarks/load.py: each one a HiCacheClient with its own device pool and pool
registration, running a random mix of Lookup / Offload / Reload / Prefetch / Evict calls
and checking every page it reads back against the page it wrote.

Device pages [0, sources) hold random data that never changes; key i names source page i
(a random 32-byte key per page, so keys of different engines never collide). Pages
[sources, device_pages) are reload targets. Every LOADED / LOADED_FROM_STORAGE page is
compared byte for byte with its source page; a NOT_FOUND page is checked untouched.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from hicache.api import KeyStatus
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.geometry import KVGeometry
from hicache.pools import DeviceKVPool

S = KeyStatus
OPS = ("lookup", "offload", "reload", "prefetch", "evict")
WEIGHTS = (30, 25, 25, 10, 10)
SERVED = (S.LOADED, S.LOADED_FROM_STORAGE)


@dataclass
class EngineTally:
    """What one engine did and saw."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    pages_checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    final_exact: int = 0
    final_missing: int = 0  # never offloaded, or evicted from host and not in storage
    final_acked_missing: int = 0  # offloaded (STORED / DEDUPLICATED) but found in no tier
    crashed: str = ""  # the exception that stopped this engine, if any


class Ops:
    """A shared budget of operations and a deadline for all engines."""

    def __init__(self, total: int, seconds: float):
        self._left, self._lock = total, threading.Lock()
        self.deadline = time.monotonic() + seconds

    def take(self) -> bool:
        with self._lock:
            if self._left <= 0 or time.monotonic() > self.deadline:
                return False
            self._left -= 1
            return True


class Engine:
    """One engine. Not thread-safe: one thread drives it."""

    def __init__(self, address: str, index: int, geometry: KVGeometry, device_pages: int, sources: int, seed: int):
        assert 0 < sources < device_pages
        self.rng = random.Random(seed * 1000 + index)
        self.dev = DeviceKVPool(geometry, device_pages)
        gen = torch.Generator().manual_seed(seed * 1000 + index)
        self.dev.flat.copy_(torch.randint(0, 256, (self.dev.nbytes,), dtype=torch.uint8, generator=gen))
        self.sources = sources
        self.keys = [self.rng.randbytes(32) for _ in range(sources)]
        self.page_of = {k: i for i, k in enumerate(self.keys)}
        self.src = [self.dev.read_page(p).clone() for p in range(sources)]
        self.scratch = list(range(sources, device_pages))
        self.held = {p: self.dev.read_page(p).clone() for p in self.scratch}  # what each scratch page holds
        self.client = HiCacheClient(address, timeout=60)
        self.client.register(self.dev, namespace=f"engine-{index}", model_id="load/model@1")
        self.tally = EngineTally()
        self.acked: set[bytes] = set()

    def _batch(self, most: int = 8) -> list[bytes]:
        return self.rng.sample(self.keys, self.rng.randint(1, min(most, len(self.keys), len(self.scratch))))

    def _timed(self, op: str, call: object) -> object | None:
        t0 = time.perf_counter()
        try:
            out = call()  # type: ignore[operator]
        except HiCacheRpcError as exc:
            self.tally.errors[f"{op}:{exc.code.name}"] += 1
            return None
        self.tally.latencies[op].append(time.perf_counter() - t0)
        return out

    def step(self) -> None:
        op = self.rng.choices(OPS, WEIGHTS)[0]
        ks = self._batch()
        if op == "lookup":
            self._timed(op, lambda: self.client.lookup(ks))
        elif op == "offload":
            r = self._timed(op, lambda: self.client.offload(ks, [self.page_of[k] for k in ks]))
            self._count(r)
            for k, s in zip(ks, getattr(r, "statuses", ()), strict=False):
                if s in (S.STORED, S.DEDUPLICATED):
                    self.acked.add(k)
        elif op == "reload":
            self.reload(ks, layerwise=self.rng.random() < 0.3)
        elif op == "prefetch":
            self._count(self._timed(op, lambda: self.client.prefetch(ks)))
        elif self.rng.random() < 0.5:
            self._count(self._timed(op, lambda: self.client.evict(ks)))
        else:
            n = self.rng.randint(1, 8)
            self._timed(op, lambda: self.client.evict(num_pages=n))

    def _count(self, result: object | None) -> None:
        for s in getattr(result, "statuses", ()):
            self.tally.statuses[s.name] += 1

    def reload(self, ks: list[bytes], *, layerwise: bool = False, op: str = "reload") -> list[KeyStatus] | None:
        """Reload ks into scratch pages and check every page: served ones exact, others untouched."""
        targets = self.rng.sample(self.scratch, len(ks))

        def call() -> tuple[KeyStatus, ...]:
            handle = self.client.reload(ks, targets, layerwise=layerwise)
            handle.wait(60)
            return handle.statuses

        statuses = self._timed(op, call)
        if statuses is None:
            return None
        assert isinstance(statuses, tuple)
        for k, page, status in zip(ks, targets, statuses, strict=True):
            self.tally.statuses[status.name] += 1
            got = self.dev.read_page(page)
            self.tally.pages_checked += 1
            want = self.src[self.page_of[k]] if status in SERVED else self.held[page]  # NOT_FOUND: untouched
            if not torch.equal(got, want):
                self.tally.mismatches.append(f"{status.name} key {k.hex()[:12]} into page {page}")
            self.held[page] = got
        return list(statuses)

    def run(self, ops: Ops) -> None:
        try:
            while ops.take():
                self.step()
        except Exception as exc:  # reported, and fails the run
            self.tally.crashed = f"{type(exc).__name__}: {exc}"

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until the sidecar has written every queued page to storage."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.client.stats()[0].storage_write_queue:
            time.sleep(0.01)

    def verify(self) -> None:
        """Final pass: read every page back, one key at a time (no prefix effects)."""
        for k in self.keys:
            statuses = self.reload([k], op="verify")
            if statuses is None:
                continue
            if statuses[0] in SERVED:
                self.tally.final_exact += 1
            else:
                self.tally.final_missing += 1
                self.tally.final_acked_missing += k in self.acked

    def close(self) -> None:
        self.client.close()
        self.dev.close()
