"""What the demo counts, its progress bar, and the summary table it ends with."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO, TypeVar

import numpy as np

from hicache.api import PoolStats

T = TypeVar("T")


@dataclass
class Tally:
    """Counters of one demo run. A check failed iff failures() is non-empty."""

    requests: int = 0
    tokens: int = 0
    device_tokens: int = 0  # served from the engine's own device cache
    host_tokens: int = 0  # reloaded from the sidecar's host pool
    storage_tokens: int = 0  # reloaded after a fetch from the storage tier
    cross_node_tokens: int = 0  # of storage_tokens, those of pages another node (engine) computed
    computed_tokens: int = 0
    offload_bytes: int = 0  # device -> host
    reload_bytes: int = 0  # host -> device
    pages_offloaded: int = 0
    pages_reloaded: int = 0
    pages_prefetched: int = 0  # storage -> host ahead of the reload
    prefetch_bytes: int = 0
    no_space: int = 0
    reload_misses: int = 0  # looked up as resident, then NOT_FOUND on reload (evicted meanwhile)
    device_evictions: int = 0
    pages_verified: int = 0  # reloaded pages checked against the digest taken when computed
    page_mismatches: int = 0
    pages_recomputed_checked: int = 0  # every page of every request against a recomputation
    recompute_mismatches: int = 0
    attention_checked: int = 0  # one per (request, layer)
    attention_mismatches: int = 0
    rpc_s: dict[str, list[float]] = field(default_factory=dict)
    require_cross_node: bool = False  # fail unless some prompt tokens came from another node's pages

    def timed(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs), its wall time recorded under `name`."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.rpc_s.setdefault(name, []).append(time.perf_counter() - t0)

    def failures(self) -> list[str]:
        out = []
        if self.page_mismatches:
            out.append(f"{self.page_mismatches} reloaded pages differ from what was offloaded")
        if self.recompute_mismatches:
            out.append(f"{self.recompute_mismatches} pages differ from a recomputation")
        if self.attention_mismatches:
            out.append(f"{self.attention_mismatches} attention outputs differ from a recomputation")
        if self.require_cross_node and not self.cross_node_tokens:
            out.append("no prompt token came from a page another node stored (--require-cross-node-hits)")

        return out

    def notices(self) -> list[str]:
        """What the run could not check, which is not a failure: a valid but small workload
        that never reloaded a page."""
        if self.requests and not self.pages_reloaded:
            return [
                "no page was reloaded from the sidecar, so no reload was checked "
                "(more --conversations or --turns, or fewer --device-pages, exercise the tiers)"
            ]
        return []


class Progress:  # plain lines, not rich: they read the same in a CI log, a pipe and a terminal
    """A one-line progress bar on a terminal; on anything else a line at every quarter."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 30):
        self.total, self.stream, self.width = max(total, 1), stream, width
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self._quarter = 0

    def update(self, done: int, note: str = "") -> None:
        frac = min(done / self.total, 1.0)
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            bar = "#" * int(frac * self.width)
            line = f"\r[{bar:<{self.width}}] {done}/{self.total} requests {elapsed:5.1f}s {note}"
            self.stream.write(line[: 120 + 1])
            self.stream.flush()
        elif int(frac * 4) > self._quarter:
            self._quarter = int(frac * 4)
            print(f"progress: {done}/{self.total} requests, {elapsed:.1f}s {note}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) * 1e3 if values else 0.0


def summary(tally: Tally, pools: list[PoolStats], elapsed_s: float, nodes: int = 1) -> str:
    """The final table; `pools` are the sidecars' stats of the demo's pools."""
    t = tally
    lines = []
    saved = t.device_tokens + t.host_tokens + t.storage_tokens

    def row(name: str, value: str) -> None:
        lines.append(f"  {name:<34} {value}")

    on = f" on {nodes} nodes" if nodes > 1 else ""
    lines.append(f"hicache demo: {t.requests} requests{on}, {t.tokens} prompt tokens in {elapsed_s:.1f} s")
    lines.append("  tokens served from" + " " * 17 + "tokens      share")
    served = [
        ("device (engine cache)", t.device_tokens),
        ("host (sidecar pool)", t.host_tokens),
        ("storage tier", t.storage_tokens),
        ("computed (prefill)", t.computed_tokens),
    ]
    if t.cross_node_tokens or nodes > 1:
        served.insert(3, ("  of which another node's", t.cross_node_tokens))
    for name, n in served:
        row(f"  {name}", f"{n:>7}  {100 * n / max(t.tokens, 1):>8.1f}%")
    row("prefill tokens saved", f"{saved} ({100 * saved / max(t.tokens, 1):.1f}%)")
    row("GB device -> host (offload)", f"{t.offload_bytes / 1e9:.3f} in {t.pages_offloaded} pages")
    row("GB host -> device (reload)", f"{t.reload_bytes / 1e9:.3f} in {t.pages_reloaded} pages")
    row("GB storage -> host (prefetch)", f"{t.prefetch_bytes / 1e9:.3f} in {t.pages_prefetched} pages")
    backends = {s.storage_backend for s in pools}
    held = sum(tier.bytes for s in pools for tier in s.tiers if tier.tier.value == "storage")
    healthy = all(s.storage_healthy for s in pools)
    size = f"{held / 1e9:.3f} GB held" if held else "size not tracked" if "redis" in backends else "0.000 GB held"
    row("storage backend", f"{'/'.join(sorted(backends))}: {size}, {'healthy' if healthy else 'DOWN'}")
    for s in pools:
        row(
            f"transfer GB/s [{s.group}] offload / reload",
            f"{s.offload_gbps:.2f} / {s.reload_gbps:.2f}  (host pool {s.used_pages}/{s.host_pages} pages)",
        )
    for name in sorted(t.rpc_s):
        v = t.rpc_s[name]
        row(f"RPC {name} p50 / p99 (n={len(v)})", f"{_pct(v, 50):.2f} / {_pct(v, 99):.2f} ms")
    row("device evictions / host NO_SPACE", f"{t.device_evictions} / {t.no_space}")
    row("reloaded pages verified bit-exact", f"{t.pages_verified - t.page_mismatches}/{t.pages_verified}")
    row(
        "pages equal to a recomputation",
        f"{t.pages_recomputed_checked - t.recompute_mismatches}/{t.pages_recomputed_checked}",
    )
    row(
        "attention outputs equal to recompute",
        f"{t.attention_checked - t.attention_mismatches}/{t.attention_checked}",
    )
    failures, notices = t.failures(), t.notices()
    if failures:
        lines.append("result: FAILED: " + "; ".join(failures))
    elif notices:
        lines.append("result: nothing to check: " + "; ".join(notices))
    else:
        lines.append("result: all checks passed")
    return "\n".join(lines)
