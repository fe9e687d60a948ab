"""`hicache replay`: replay a KV-cache trace through real sidecar processes and compare what
they served with the exact prefix LRU of the same size on the same requests.

Each node is a sidecar process (`hicache-server`) and an engine replaying its share of the
requests (hicache.replay.node): round-robin, or by the request's first block (a router that
keeps a prefix on one node). Every block of the trace is one page of a tiny model (one
layer, one KV head of 8, page 16: 512 bytes) unless --model-config says otherwise; a
block's page is a function of its key, and every page reloaded is checked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from typing import Any

from hicache.api import PoolStats
from hicache.demo.configs import load_config
from hicache.demo.run import local_cluster
from hicache.demo.sidecar import SidecarProcess
from hicache.geometry import model_geometries
from hicache.replay import lru
from hicache.replay.node import ReplayNode
from hicache.replay.trace import Request, load_trace

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "hidden_size": 8,
    "head_dim": 8,
    "vocab_size": 1 << 31,
    "torch_dtype": "bfloat16",
}
SWEEP_TOKENS = (100_000, 300_000, 1_000_000, 3_000_000, 10_000_000, 30_000_000)
SHARED_BACKENDS = ("redis", "redis-cluster", "mooncake")  # one tier all nodes share


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a trace: Mooncake's JSONL (hash_ids), or one token-id prompt per line")
    p.add_argument("--first", type=int, default=0, help="skip this many requests")
    p.add_argument("--requests", type=int, default=None, help="replay this many (default: all)")
    p.add_argument("--host-size", type=float, default=1e6, help="host tier per node, in tokens")
    p.add_argument("--hicache-storage-backend", default="file", help="file, redis, redis-cluster, mooncake, none")
    p.add_argument("--hicache-storage-backend-extra-config", default="", help="the backend's JSON options")
    p.add_argument("--hicache-write-policy", default="write_through")
    p.add_argument("--nodes", type=int, default=1, help="sidecar + engine pairs (over one tier where it is shared)")
    p.add_argument("--route", choices=("round-robin", "prefix"), default="round-robin", help="request -> node")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (a trace block is one page)")
    p.add_argument("--model-config", default=None, help="an HF config.json (default: a tiny one, 512-byte pages)")
    p.add_argument("--speed", type=float, default=0.0, help="0: as fast as accepted; s > 0: timestamps / s")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--report-json", default=None, help="also write the JSON report to this file")


def _route(requests: list[Request], nodes: int, how: str) -> list[list[Request]]:
    shares: list[list[Request]] = [[] for _ in range(nodes)]
    for i, r in enumerate(requests):
        at = i if how == "round-robin" or not r.blocks else r.blocks[0]
        shares[at % nodes].append(r)
    return shares


def _sidecar_args(args: argparse.Namespace, config_path: str, workdir: str, node: int, host_bytes: int) -> list[str]:
    extra = args.hicache_storage_backend_extra_config
    if not extra and args.hicache_storage_backend == "file":
        extra = json.dumps({"dir": os.path.join(workdir, f"storage-{node}")})
    return [
        "--model-config", config_path, "--page-size", str(args.page_size), "--kv-cache-dtype", "bfloat16",
        "--hicache-size", repr(host_bytes / 1e9), "--hicache-storage-backend", args.hicache_storage_backend,
        "--hicache-storage-backend-extra-config", extra, "--hicache-write-policy", args.hicache_write_policy,
        "--log-level", "WARNING",
    ]  # fmt: skip


def _settle(node: ReplayNode, timeout_s: float = 120.0) -> PoolStats:
    """The node's stats once its storage writes are done (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        (st,) = node.client.stats()
        if st.storage_write_queue == 0 or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def run_replay(args: argparse.Namespace) -> int:
    for flag, value in (("--nodes", args.nodes), ("--page-size", args.page_size)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.host_size < 1 or args.speed < 0:
        raise ValueError(f"--host-size must be >= 1 token and --speed >= 0, got {args.host_size} and {args.speed}")
    requests = load_trace(args.trace, page_size=args.page_size, first=args.first, count=args.requests)
    if not requests:
        raise ValueError(f"{args.trace} has no requests to replay from --first {args.first}")
    config = TINY_CONFIG if args.model_config is None else load_config(args.model_config)
    geometry = model_geometries(config, tp_size=1, page_size=args.page_size, dtype="bfloat16")["full"]
    block_tokens = requests[0].block_tokens
    host_pages = max(1, int(args.host_size // block_tokens))
    device_pages = max(len(r.blocks) for r in requests)
    shares = _route(requests, args.nodes, args.route)
    with tempfile.TemporaryDirectory(prefix="hicache-replay-") as workdir, contextlib.ExitStack() as stack:
        config_path = os.path.join(workdir, "config.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        if args.hicache_storage_backend == "redis-cluster" and not args.hicache_storage_backend_extra_config:
            args.hicache_storage_backend_extra_config = json.dumps(
                {"url": stack.enter_context(local_cluster(workdir)).url}
            )
        host_bytes = host_pages * geometry.page_bytes + geometry.page_bytes // 2
        sidecars = []
        for n in range(args.nodes):
            folder = os.path.join(workdir, f"node-{n}")
            os.makedirs(folder)
            sidecars.append(
                stack.enter_context(SidecarProcess(_sidecar_args(args, config_path, workdir, n, host_bytes), folder))
            )
        for sc in sidecars:
            sc.wait_ready()
        nodes = [ReplayNode(sc.target, geometry, device_pages, model_id="replay") for sc in sidecars]
        for node in nodes:
            stack.callback(node.close)
        errors: list[BaseException] = []
        start = time.monotonic()

        def serve(node: ReplayNode, share: list[Request]) -> None:
            try:
                node.serve(share, start, args.speed)
            except BaseException as exc:
                errors.append(exc)
                for other in nodes:
                    other.stop()

        threads = [threading.Thread(target=serve, args=(nd, sh)) for nd, sh in zip(nodes, shares, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        if errors:
            raise errors[0]
        stats = [_settle(node) for node in nodes]
        report = _report(args, requests, shares, nodes, stats, elapsed, host_pages, geometry.page_bytes)
    _print(report, args)
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["corrupt_pages"] == 0 else 1


def _report(
    args: argparse.Namespace,
    requests: list[Request],
    shares: list[list[Request]],
    nodes: list[ReplayNode],
    stats: list[PoolStats],
    elapsed: float,
    host_pages: int,
    page_bytes: int,
) -> dict[str, Any]:
    results = [n.result for n in nodes]
    total = sum(r.input_tokens for r in results)
    hits = {tier: sum(r.hit_tokens[tier] for r in results) for tier in ("host", "storage")}
    rate = {tier: n / total for tier, n in hits.items()}
    rate["total"] = sum(rate.values())
    backend = args.hicache_storage_backend
    n = args.nodes
    host_only = lru.shares_hit_rate(shares, host_pages)
    if backend == "none":
        expected = host_only
    else:
        caps = [st.tiers[1].capacity_bytes for st in stats]
        sizes = [st.tiers[1].bytes // st.tiers[1].pages for st in stats if st.tiers[1].pages]
        cap = None if not caps[0] or not sizes else max(host_pages, caps[0] // sizes[0])
        if backend in SHARED_BACKENDS:  # one tier: every node's pages, pooled
            expected = lru.hit_rate(requests, cap)
        else:
            expected = lru.shares_hit_rate(shares, cap)
    answers = {k: sum(r.offload_answers[k] for r in results) for k in results[0].offload_answers}
    tiers = stats[:1] if backend in SHARED_BACKENDS else stats  # a shared tier's pages are one tier's
    pages_known = backend != "none" and all(st.tiers[1].capacity_bytes or st.tiers[1].pages for st in tiers)
    latencies = sorted(x for r in results for x in r.latencies_s)
    moved = sum(r.pages_reloaded + r.pages_offloaded for r in results)
    return {
        "trace": args.trace,
        "requests": len(requests),
        "nodes": n,
        "route": args.route,
        "page_size": args.page_size,
        "page_bytes": page_bytes,
        "host_tokens_per_node": host_pages * requests[0].block_tokens,
        "host_pages_per_node": [st.host_pages for st in stats],
        "storage_backend": backend,
        "hit_rate": {k: round(v, 4) for k, v in rate.items()},
        "lru_expectation": {"host_only": round(host_only, 4), "host_plus_storage": round(expected, 4)},
        "ratio": round(rate["total"] / expected, 4) if expected else None,
        "offload_pages": answers,
        "storage_writes": {  # each node's writer: a page two nodes offloaded is written twice
            "done": sum(st.writes_done for st in stats),
            "dropped": sum(st.writes_dropped for st in stats),
            "failed": sum(st.write_failures for st in stats),
        },
        "storage_pages": sum(st.tiers[1].pages for st in tiers) if pages_known else None,  # None: not counted
        "pages_per_s": round(moved / elapsed, 1) if elapsed else 0.0,
        "latency_ms": {
            "p50": round(1e3 * statistics.median(latencies), 3),
            "p99": round(1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
        },
        "pages_checked": sum(r.pages_checked for r in results),
        "corrupt_pages": sum(r.corrupt_pages for r in results),
        "lookup_reload_gaps": sum(r.lookup_reload_gaps for r in results),
        "elapsed_s": round(elapsed, 2),
        "sweep": [
            {"tokens_per_node": c, "lru_hit_rate": round(h, 4)} for c, h in lru.sweep(requests, [*SWEEP_TOKENS], n)
        ]
        + [{"tokens_per_node": None, "lru_hit_rate": round(lru.hit_rate(requests, None, n), 4)}],
        "nodes_detail": [asdict(r) | {"latencies_s": None} for r in results],
    }


def _print(report: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(report, indent=2))
        return
    r = report
    print(f"hicache replay: {r['requests']} requests of {r['trace']} over {r['nodes']} node(s), "
          f"{r['host_tokens_per_node']} host tokens each, storage {r['storage_backend']}, in {r['elapsed_s']} s")  # fmt: skip
    hr, lx = r["hit_rate"], r["lru_expectation"]
    print(f"  hit rate (tokens)    host {hr['host']:.4f}  storage {hr['storage']:.4f}  total {hr['total']:.4f}")
    print(f"  LRU expectation      host only {lx['host_only']:.4f}  host + storage {lx['host_plus_storage']:.4f}"
          f"  ratio {r['ratio']}")  # fmt: skip
    print(f"  offloaded pages      {r['offload_pages']}")
    held = "not counted by this tier" if r["storage_pages"] is None else r["storage_pages"]
    print(f"  storage writes       {r['storage_writes']}  pages in storage: {held}")
    print(f"  pages/s {r['pages_per_s']}  latency p50 {r['latency_ms']['p50']} ms  p99 {r['latency_ms']['p99']} ms")
    print(f"  pages checked {r['pages_checked']}  corrupt {r['corrupt_pages']}")
    print("  LRU hit rate by size per node (tokens):  " + "  ".join(
        f"{s['tokens_per_node'] or 'unbounded'}: {s['lru_hit_rate']:.3f}" for s in r["sweep"]))  # fmt: skip
    sys.stdout.flush()
