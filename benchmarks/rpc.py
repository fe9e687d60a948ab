"""Sidecar RPC latency over a Unix socket, and sidecar offload bandwidth as a ratio to the
in-process TransferEngine and to a contiguous memcpy of the same bytes, in one run.

    python benchmarks/rpc.py                 # MiMo-V2-Flash full group, page 64, bf16
    python benchmarks/rpc.py --json

The sidecar runs as its own process (`python -m server`) on a temporary socket; this process
is the engine with a CPU DeviceKVPool in shared memory; the sidecar has no storage tier.
Latencies are p50/p99 of --iters
calls (wall time of the client call). Offloads use fresh keys each call, so every page is
copied (no deduplication); older fresh keys are evicted (LRU) to make room, 1000 pinned
keys stay resident for the Lookups.
  sidecar_gbps     bytes / wall time of client.offload(256 pages), RPC included
  engine_gbps      TransferEngine.offload of the same device pages into scattered host pages, in this process
  memcpy_gbps      one contiguous copy of the same number of bytes
  echo             the floor of one call: the health service's Check, a bare unary RPC on the same socket
  reload_layerwise_1  Reload of one page, layer-wise, waited for layer by layer (wait_layer for
                   every layer, then wait): the call and the waits, over `echo` in
                   reload_layerwise_over_echo
  layer_waits      the layer waits alone (after the Reload call returned), over one echo call in
                   layer_waits_over_echo: what an engine pays per forward for the layer signals
  reload_16, reload_layerwise_16, reload_layerwise_16_first_layer  a plain and a layer-wise
                   Reload of 16 resident pages (23.6 MB, copied after the answer), the latter
                   to its last and to its first layer; over the plain one in
                   layerwise_over_plain_mid and first_layer_over_plain_mid
  concurrent       --engines engine processes (default 4), each with a pool of its own, call the
                   sidecar at once: in each round first a burst of echo calls (the floor of a call
                   under that load, `echo`), then a burst of Offloads of 1-4 fresh pages and
                   Reloads of 1-4 resident pages (`rpc`: both, and each alone); p99_over_p50 of
                   the transfers and rpc_p50_over_echo_p50 (goals: <= 2 and <= 1.5); the
                   echo's own echo_p99_over_p50, and rpc_p99_over_echo_p99 (the tail against the
                   floor's tail); copy_ms_mean, the sidecar's own copy per transfer (its pools'
                   stats: offload and reload seconds over the timed calls), and
                   rpc_p50_over_echo_p50_plus_copy, over a call plus that copy
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from hicache import DeviceKVPool, HostKVPool, TransferEngine  # noqa: E402
from hicache.client import HiCacheClient  # noqa: E402
from hicache.demo import load_config  # noqa: E402
from hicache.geometry import model_geometries  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pages", type=int, default=256, help="pages per large offload")
    p.add_argument("--iters", type=int, default=200, help="calls per small-call latency figure")
    p.add_argument("--big-iters", type=int, default=12, help="calls per large-offload figure")
    p.add_argument("--layout", default="layer_first", help="host pool layout (sidecar and in-process engine)")
    p.add_argument("--engines", type=int, default=4, help="engine processes calling at once (the concurrent case)")
    p.add_argument("--concurrent-only", action="store_true", help="measure only the concurrent engines' case")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.engines < 1 or args.iters < 2:
        p.error(f"--engines must be >= 1 and --iters >= 2, got {args.engines} and {args.iters}")
    return args


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = np.array(samples) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def timed(fn: Callable[[int], Any], iters: int, warmup: int = 3) -> list[float]:
    for i in range(warmup):
        fn(-1 - i)
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def layer_signals(client: HiCacheClient, sock: str, key: bytes, layers: int, iters: int) -> dict[str, Any]:
    """The echo floor, a layer-wise 1-page Reload waited per layer, and the layer waits alone."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix://{sock}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        echo = timed(lambda i: health.Check(health_pb2.HealthCheckRequest(service="")), iters)

    def reload_waited(_: int) -> None:
        h = client.reload([key], [1], layerwise=True)
        for layer in range(layers):
            h.wait_layer(layer)
        h.wait()

    reload = timed(reload_waited, iters)
    waits = []
    for _ in range(iters):
        h = client.reload([key], [1], layerwise=True)
        t0 = time.perf_counter()
        for layer in range(layers):
            h.wait_layer(layer)
        h.wait()
        waits.append(time.perf_counter() - t0)
    floor = statistics.median(echo)
    return {
        "echo": percentiles(echo),
        "reload_layerwise_1": percentiles(reload),
        "reload_layerwise_over_echo": statistics.median(reload) / floor,
        "layer_waits": {**percentiles(waits), "layers": layers},
        "layer_waits_over_echo": statistics.median(waits) / floor,
    }


ENGINE_PAGES = 8  # each concurrent engine's device pool: pages 0-3 offloaded, 4-7 reloaded into
SMALL_MAX = 4  # a concurrent engine's transfers are of 1 to SMALL_MAX pages


def engine_calls(
    sock: str, page_size: int, index: int, rounds: int, calls: int, barrier: Any, out: Any
) -> None:  # pragma: no cover - runs in an engine process
    """One concurrent engine (a process of its own): register a pool, keep SMALL_MAX pinned
    resident pages, then per round an echo burst and a transfer burst of `calls` each, the
    rounds in step with the other engines (`barrier`); put (index, samples, refused, the
    sidecar's copy seconds over the timed calls) on `out`."""
    import random

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    g = _geometry(page_size)
    dev = DeviceKVPool(g, ENGINE_PAGES)
    dev.flat.copy_(torch.randint(0, 256, (dev.nbytes,), dtype=torch.uint8))
    client = HiCacheClient(f"unix://{sock}", timeout=120)
    samples: dict[str, list[float]] = {"echo": [], "offload": [], "reload": []}
    refused: Counter[str] = Counter()
    try:
        # a namespace each: pools of one namespace and model share a host cache, and the
        # pinned pages of every engine would crowd the others' offloads out (NO_SPACE)
        client.register(dev, model_id="MiMo-V2-Flash", namespace=f"engine-{index}")
        counter = iter(range(10**9))

        def fresh(n: int) -> list[bytes]:
            return [(index << 40 | next(counter)).to_bytes(32, "little") for _ in range(n)]

        resident = fresh(SMALL_MAX)
        client.offload(resident, list(range(SMALL_MAX)))
        client.pin(resident)
        rng = random.Random(index)
        offload_pages, reload_pages = list(range(SMALL_MAX)), list(range(SMALL_MAX, 2 * SMALL_MAX))

        def transfer(i: int, record: bool) -> None:
            n = rng.randint(1, SMALL_MAX)
            t0 = time.perf_counter()
            if i % 2 == 0:
                statuses = client.offload(fresh(n), offload_pages[:n]).statuses
                kind, want = "offload", "STORED"
            else:
                statuses = client.reload(resident[:n], reload_pages[:n]).statuses
                kind, want = "reload", "LOADED"
            if record:
                samples[kind].append(time.perf_counter() - t0)
                refused.update(s.name for s in statuses if s.name != want)

        with grpc.insecure_channel(f"unix://{sock}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="")
            for i in range(10):  # warm-up: channels, the copy templates
                health.Check(check)
                transfer(i, False)
            copy_s = -copy_seconds(client)
            for _ in range(rounds):
                barrier.wait()
                for _ in range(calls):
                    t0 = time.perf_counter()
                    health.Check(check)
                    samples["echo"].append(time.perf_counter() - t0)
                barrier.wait()
                for i in range(calls):
                    transfer(i, True)
            copy_s += copy_seconds(client)
    finally:
        client.close()
        dev.close()
    out.put((index, samples, dict(refused), copy_s))


def copy_seconds(client: HiCacheClient) -> float:
    """The seconds the sidecar has spent copying for the client's pool (offloads and reloads,
    from its stats: bytes over GB/s)."""
    (s,) = client.stats()
    return sum(b / (g * 1e9) for b, g in ((s.offload_bytes, s.offload_gbps), (s.reload_bytes, s.reload_gbps)) if g > 0)


def concurrent_engines(sock: str, page_size: int, engines: int, iters: int) -> dict[str, Any]:
    """--engines processes calling the sidecar at once (see engine_calls); the figures over
    every call of every engine."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    rounds = 5
    calls = max(2, iters // rounds)
    barrier, out = ctx.Barrier(engines), ctx.Queue()
    procs = [
        ctx.Process(target=engine_calls, args=(sock, page_size, i, rounds, calls, barrier, out)) for i in range(engines)
    ]
    for p in procs:
        p.start()
    results: list[Any] = []
    try:
        while len(results) < engines:
            try:
                results.append(out.get(timeout=1))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"rpc.py: an engine process failed (exit codes {dead})") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    merged: dict[str, list[float]] = {"echo": [], "offload": [], "reload": []}
    refused: Counter[str] = Counter()
    copy_s = 0.0
    for _, samples, bad, copied in results:
        for kind, values in samples.items():
            merged[kind] += values
        refused.update(bad)
        copy_s += copied
    if refused:
        raise SystemExit(f"rpc.py: concurrent engines: pages answered {dict(refused)}: the figures would be wrong")
    rpc = merged["offload"] + merged["reload"]
    echo_p50, echo_p99 = (float(np.percentile(merged["echo"], q)) for q in (50, 99))
    rpc_p50, rpc_p99 = (float(np.percentile(rpc, q)) for q in (50, 99))
    copy_mean = copy_s / len(rpc)
    out_rows = {kind: percentiles(values) for kind, values in merged.items()}
    out_rows["rpc"] = percentiles(rpc)
    return {
        **out_rows,
        "engines": engines,
        "calls": len(rpc),
        "p99_over_p50": rpc_p99 / rpc_p50,
        "rpc_p50_over_echo_p50": rpc_p50 / echo_p50,
        "echo_p99_over_p50": echo_p99 / echo_p50,
        "rpc_p99_over_echo_p99": rpc_p99 / echo_p99,
        "copy_ms_mean": copy_mean * 1e3,
        "rpc_p50_over_echo_p50_plus_copy": rpc_p50 / (echo_p50 + copy_mean),
    }


def _geometry(page_size: int) -> Any:
    return model_geometries(load_config(None), tp_size=1, page_size=page_size, dtype="bfloat16")["full"]


MID_PAGES = 16  # 23.6 MB: above the size the sidecar copies before answering (4 MB)


def layerwise_reload(client: HiCacheClient, keys: list[bytes], layers: int, iters: int) -> dict[str, Any]:
    """A layer-wise Reload of MID_PAGES pages against a plain one of the same pages: the time
    until the first layer is usable (the call and wait_layer(0)) and until all are."""
    pages = list(range(len(keys)))
    plain = timed(lambda i: client.reload(keys, pages).wait(), iters)
    first, whole = [], []
    for _ in range(iters + 3):
        t0 = time.perf_counter()
        h = client.reload(keys, pages, layerwise=True)
        h.wait_layer(0)
        first.append(time.perf_counter() - t0)
        for layer in range(1, layers):
            h.wait_layer(layer)
        h.wait()
        whole.append(time.perf_counter() - t0)
    first, whole = first[3:], whole[3:]  # as timed(): the first calls warm up
    return {
        f"reload_{len(keys)}": percentiles(plain),
        f"reload_layerwise_{len(keys)}": percentiles(whole),
        f"reload_layerwise_{len(keys)}_first_layer": percentiles(first),
        "layerwise_over_plain_mid": statistics.median(whole) / statistics.median(plain),
        "first_layer_over_plain_mid": statistics.median(first) / statistics.median(plain),
    }


def all_stored(results: list[Any], what: str) -> None:
    """Exit naming `what` unless every page of the timed offloads `results` was STORED: a
    page refused (no room) copies nothing, and its time would flatter the figures."""
    refused = Counter(s.name for r in results for s in r.statuses if s.name != "STORED")
    if refused:
        raise SystemExit(f"rpc.py: {what}: pages answered {dict(refused)}, not STORED: the figures would be wrong")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    g = _geometry(args.page_size)
    device_pages = 2 * args.pages
    # host pages: 1000 pinned resident keys for Lookup, and room for a large offload plus
    # the pages it evicts (least recently used fresh keys) before the copy
    ratio = (1000 + 2 * args.pages) / device_pages
    sockdir = tempfile.mkdtemp(prefix="hcb")
    sock = os.path.join(sockdir, "hc.sock")
    server = subprocess.Popen(
        [sys.executable, "-m", "server", "--socket", sock, "--page-size", str(args.page_size)]
        + ["--hicache-ratio", str(ratio), "--hicache-mem-layout", args.layout, "--log-level", "WARNING"]
        # host memory only: a storage tier's queued writes hold host pages (NO_SPACE under a
        # burst of large offloads) and its I/O is measured by benchmarks/tiers.py
        + ["--hicache-storage-backend", "none"],
        cwd=ROOT,
        stdout=sys.stderr,  # keep this process's stdout for the report (--json must parse)
    )
    rows: dict[str, Any] = {"geometry": f"MiMo-V2-Flash full, K {g.head_dim} / V {g.v_head_dim}, page {g.page_size}"}
    try:
        if not args.concurrent_only:
            rows.update(single_client(args, sock, device_pages))
        else:
            _wait_for(sock)
        rows["concurrent"] = concurrent_engines(sock, args.page_size, args.engines, args.iters)
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(sockdir, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"hicache sidecar over UDS: {rows['geometry']}, page_bytes {g.page_bytes}")
    if not args.concurrent_only:
        print_single(rows, args.pages)
    c = rows["concurrent"]
    print(f"  {c['engines']} engines at once, Offload / Reload of 1-{SMALL_MAX} pages ({c['calls']} calls):")
    for name in ("echo", "rpc", "offload", "reload"):
        print(f"    {name:16} p50 {c[name]['p50_ms']:9.3f} ms   p99 {c[name]['p99_ms']:9.3f} ms")
    print(
        f"    p99 / p50 {c['p99_over_p50']:.2f} (goal <= 2); p50 / echo p50 {c['rpc_p50_over_echo_p50']:.2f} (goal <= 1.5)"
    )
    print(
        f"    echo's own p99 / p50 {c['echo_p99_over_p50']:.2f}; p99 / echo p99 {c['rpc_p99_over_echo_p99']:.2f}; "
        f"the sidecar's copy {c['copy_ms_mean']:.3f} ms a call (mean), "
        f"p50 / (echo p50 + copy) {c['rpc_p50_over_echo_p50_plus_copy']:.2f}"
    )
    return 0


def _wait_for(sock: str) -> None:
    """Until the sidecar answers on `sock` (the single-client part's register waits too)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix://{sock}") as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=120)


def single_client(args: argparse.Namespace, sock: str, device_pages: int) -> dict[str, Any]:
    """The figures of one engine alone (see the module docstring)."""
    g = _geometry(args.page_size)
    dev = DeviceKVPool(g, device_pages)
    dev.flat.copy_(torch.randint(0, 256, (dev.nbytes,), dtype=torch.uint8))
    rows: dict[str, Any] = {}
    try:
        client = HiCacheClient(f"unix://{sock}", timeout=120)
        client.register(dev, model_id="MiMo-V2-Flash")
        counter = iter(range(10**9))

        def fresh(n: int) -> list[bytes]:
            return [next(counter).to_bytes(32, "little") for _ in range(n)]

        resident = fresh(1000)
        for start in range(0, 1000, args.pages):
            chunk = resident[start : start + args.pages]
            client.offload(chunk, list(range(len(chunk))))
        client.pin(resident)
        rows["lookup_1"] = percentiles(timed(lambda i: client.lookup(resident[:1]), args.iters))
        rows["lookup_1000"] = percentiles(timed(lambda i: client.lookup(resident), args.iters))
        small: list[Any] = []  # the answers, checked after the timing
        rows["offload_1"] = percentiles(timed(lambda i: small.append(client.offload(fresh(1), [0])), args.iters))
        all_stored(small, "offload_1")
        rows.update(layer_signals(client, sock, resident[0], g.layer_num, args.iters))
        rows.update(layerwise_reload(client, resident[:MID_PAGES], g.layer_num, args.iters))
        big = list(range(args.pages))
        large: list[Any] = []
        big_samples = timed(lambda i: large.append(client.offload(fresh(args.pages), big)), args.big_iters)
        all_stored(large, f"offload_{args.pages}")
        rows[f"offload_{args.pages}"] = percentiles(big_samples)
        nbytes = args.pages * g.page_bytes
        sidecar_gbps = nbytes / statistics.median(big_samples) / 1e9

        host = HostKVPool(g, 2 * args.pages, args.layout)
        engine = TransferEngine(dev, host)
        # The sidecar's host pages are wherever its LRU freed them: scattered, so scatter these too.
        scattered = np.random.default_rng(0).permutation(2 * args.pages)[: args.pages]
        engine_s = statistics.median(timed(lambda i: engine.offload(big, scattered), args.big_iters))
        src, dst = dev.flat[:nbytes], host.flat[:nbytes]
        memcpy_s = statistics.median(timed(lambda i: dst.copy_(src), args.big_iters))
        engine_gbps, memcpy_gbps = nbytes / engine_s / 1e9, nbytes / memcpy_s / 1e9
        rows["offload_bandwidth"] = {
            "pages": args.pages,
            "bytes": nbytes,
            "sidecar_gbps": sidecar_gbps,
            "engine_gbps": engine_gbps,
            "memcpy_gbps": memcpy_gbps,
            "sidecar_over_engine": sidecar_gbps / engine_gbps,
            "sidecar_over_memcpy": sidecar_gbps / memcpy_gbps,
        }
        host.close()
        client.close()
    finally:
        dev.close()
    return rows


def print_single(rows: dict[str, Any], pages: int) -> None:
    for name in (
        "echo",
        "lookup_1",
        "lookup_1000",
        "offload_1",
        "reload_layerwise_1",
        "layer_waits",
        f"reload_{MID_PAGES}",
        f"reload_layerwise_{MID_PAGES}",
        f"reload_layerwise_{MID_PAGES}_first_layer",
        f"offload_{pages}",
    ):
        print(f"  {name:18} p50 {rows[name]['p50_ms']:9.3f} ms   p99 {rows[name]['p99_ms']:9.3f} ms")
    print(
        f"  layer-wise 1-page Reload / echo {rows['reload_layerwise_over_echo']:.2f}; "
        f"{rows['layer_waits']['layers']} layer waits / echo {rows['layer_waits_over_echo']:.2f}"
    )
    print(
        f"  {MID_PAGES}-page Reload, layer-wise over plain {rows['layerwise_over_plain_mid']:.2f}; "
        f"its first layer usable after {rows['first_layer_over_plain_mid']:.2f} of the plain one"
    )
    b = rows["offload_bandwidth"]
    print(
        f"  offload {b['pages']} pages ({b['bytes'] / 1e6:.0f} MB): sidecar {b['sidecar_gbps']:.2f} GB/s, "
        f"in-process engine {b['engine_gbps']:.2f} GB/s, memcpy {b['memcpy_gbps']:.2f} GB/s"
    )
    print(f"  ratio sidecar/engine {b['sidecar_over_engine']:.2f}, sidecar/memcpy {b['sidecar_over_memcpy']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
