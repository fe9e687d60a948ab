"""Load: concurrent engines drive one sidecar over a Unix socket with a mixed workload, and
every page read back is compared with what was written.

    python benchmarks/load.py                       # 8 engines, 20,000 operations, at most 60 s
    python benchmarks/load.py --json

The sidecar runs as its own process (`python -m server`, file tier under a temporary folder,
write_through, host pool at half the device pool so pages move between host and storage).
Each engine is a thread of this process with its own HiCacheClient, CPU device pool and
registration (its own namespace); see load_workload.py for the mix. Reported: throughput,
p50/p99/p999 latency (overall and per call), gRPC errors by code (any is unexpected), page
checks during the run, and a final pass that reads every page back. The run fails (exit 1)
on any mismatch, any error, or any acknowledged page that no tier holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_workload import Engine, Ops  # noqa: E402

from hicache.geometry import KVGeometry, model_geometries  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8, help="concurrent engines")
    p.add_argument("--ops", type=int, default=20_000, help="operations in all (shared by the engines)")
    p.add_argument("--seconds", type=float, default=60.0, help="stop after this long even if ops remain")
    p.add_argument("--device-pages", type=int, default=64)
    p.add_argument("--sources", type=int, default=48, help="device pages holding data (one key each)")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="MiMo-V2-Flash full-attention layers kept")
    p.add_argument("--backend", default="file", choices=["file", "none"])
    p.add_argument("--ratio", type=float, default=0.5, help="host pages per device page")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def geometry(page_size: int, layers: int) -> KVGeometry:
    """MiMo-V2-Flash's full-attention group (K 192 / V 128, bf16), cut to `layers` layers."""
    with open(ROOT / "tests" / "fixtures" / "model_configs" / "mimo_v2_flash.json") as f:
        g = model_geometries(json.load(f), tp_size=1, page_size=page_size, dtype="bfloat16")["full"]
    layers = min(layers, g.layer_num)
    return KVGeometry(**dict(g.to_dict(), layer_num=layers, layer_ids=g.layer_ids[:layers]))


def start_sidecar(folder: str, backend: str, ratio: float) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m server` on a socket in `folder`; returns once it listens. Raises RuntimeError."""
    sock = os.path.join(folder, "hc.sock")
    args = ["--socket", sock, "--hicache-storage-backend", backend, "--hicache-ratio", str(ratio)]
    if backend == "file":
        args += ["--hicache-storage-backend-extra-config", json.dumps({"dir": os.path.join(folder, "tier")})]
    proc = subprocess.Popen([sys.executable, "-m", "server", *args, "--log-level", "WARNING"], cwd=ROOT)
    for _ in range(6000):
        if os.path.exists(sock):
            return proc, f"unix://{sock}"
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.kill()
    raise RuntimeError(f"the sidecar did not start: {' '.join(args)}")


def percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"n": 0}
    ms = np.array(samples) * 1e3
    return {"n": len(samples), **{f"p{q}_ms": round(float(np.percentile(ms, p)), 3) for q, p in _QS}}


_QS = (("50", 50), ("99", 99), ("999", 99.9))


def run_load(
    address: str,
    *,
    clients: int = 8,
    ops: int = 20_000,
    seconds: float = 60.0,
    device_pages: int = 64,
    sources: int = 48,
    page_size: int = 4,
    layers: int = 2,
    seed: int = 0,
    durable: bool = True,
) -> dict[str, Any]:
    """Run the workload against the sidecar at `address`; returns the report (see main).
    durable: the sidecar has a storage tier that keeps every acknowledged page."""
    g = geometry(page_size, layers)
    engines = [Engine(address, i, g, device_pages, sources, seed) for i in range(clients)]
    budget = Ops(ops, seconds)
    threads = [threading.Thread(target=e.run, args=(budget,), name=f"engine-{i}") for i, e in enumerate(engines)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for e in engines:
        e.settle()
        e.verify()
    tallies = [e.tally for e in engines]
    for e in engines:
        e.close()
    per_op: dict[str, list[float]] = {}
    for t in tallies:
        for op, samples in t.latencies.items():
            per_op.setdefault(op, []).extend(samples)
    run_ops = {op: s for op, s in per_op.items() if op != "verify"}
    done = sum(len(s) for s in run_ops.values())
    errors = sum((t.errors for t in tallies), Counter())
    report = {
        "clients": clients,
        "operations": done + sum(errors.values()),
        "seconds": round(elapsed, 2),
        "ops_per_s": round((done + sum(errors.values())) / elapsed, 1),
        "latency_all": percentiles([x for s in run_ops.values() for x in s]),
        "latency": {op: percentiles(s) for op, s in sorted(run_ops.items())},
        "errors": dict(errors),
        "statuses": dict(sum((t.statuses for t in tallies), Counter())),
        "pages_checked": sum(t.pages_checked for t in tallies),
        "mismatches": [m for t in tallies for m in t.mismatches][:20],
        "final_pages_exact": sum(t.final_exact for t in tallies),
        "final_pages_missing": sum(t.final_missing for t in tallies),
        "final_acknowledged_missing": sum(t.final_acked_missing for t in tallies),
        "geometry": {"page_bytes": g.page_bytes, "layers": g.layer_num, "page_size": g.page_size},
    }
    mismatched = sum(len(t.mismatches) for t in tallies)
    report["exact_fraction"] = 1.0 - mismatched / max(1, report["pages_checked"])
    report["crashed"] = [t.crashed for t in tallies if t.crashed]
    report["ok"] = (
        mismatched == 0
        and not errors
        and not report["crashed"]
        and (not durable or report["final_acknowledged_missing"] == 0)
    )
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = tempfile.mkdtemp(prefix="hcload")
    proc, address = start_sidecar(folder, args.backend, args.ratio)
    try:
        report = run_load(
            address,
            clients=args.clients,
            ops=args.ops,
            seconds=args.seconds,
            device_pages=args.device_pages,
            sources=args.sources,
            page_size=args.page_size,
            layers=args.layers,
            seed=args.seed,
            durable=args.backend == "file",
        )
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["ok"] else 1


def print_report(r: dict[str, Any]) -> None:
    print(f"{r['clients']} engines, {r['operations']} operations in {r['seconds']} s: {r['ops_per_s']} ops/s")
    print(
        f"page {r['geometry']['page_bytes']} bytes ({r['geometry']['layers']} layers x {r['geometry']['page_size']} tokens)"
    )
    print(f"{'call':<10}{'n':>8}{'p50 ms':>10}{'p99 ms':>10}{'p999 ms':>10}")
    for op, p in [("all", r["latency_all"]), *r["latency"].items()]:
        print(f"{op:<10}{p['n']:>8}{p.get('p50_ms', 0):>10}{p.get('p99_ms', 0):>10}{p.get('p999_ms', 0):>10}")
    print(f"errors by code: {r['errors'] or 'none'}")
    print(f"statuses: {r['statuses']}")
    print(f"pages checked byte for byte: {r['pages_checked']}, exact fraction {r['exact_fraction']:.6f}")
    print(
        f"final pass: {r['final_pages_exact']} exact, {r['final_pages_missing']} missing "
        f"({r['final_acknowledged_missing']} of them acknowledged)"
    )
    if r["crashed"]:
        print("ENGINES CRASHED:", *r["crashed"], sep="\n  ")
    if r["mismatches"]:
        print("MISMATCHES:", *r["mismatches"], sep="\n  ")
    print("OK" if r["ok"] else "FAILED")


if __name__ == "__main__":
    sys.exit(main())
