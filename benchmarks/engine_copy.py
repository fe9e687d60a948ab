"""The engine-copy path (memory the sidecar cannot map) against a real sidecar, as a ratio to
a contiguous copy of the same bytes in the same run.

    python benchmarks/engine_copy.py                 # MiMo-V2-Flash full, page 64, bf16, 64 pages
    python benchmarks/engine_copy.py --pages 256 --json

Two engines' pools register with one `python -m server` process: one in private memory (the
engine copies: offloads into the pool's copy window, which the sidecar copies into the host
pool at EndCopy, the window being what keeps one member from writing another's pages;
reloads straight from the host pool, mapped read-only), one in shared memory (the sidecar
copies). Each offloads --pages pages under fresh keys and reloads them, --repeat times,
alternating. Reported (medians):
  {engine,sidecar}_{offload,reload}_ratio  memcpy time of the same bytes over the call's time
  engine_over_sidecar_{offload,reload}     the engine-copy call's time over the sidecar path's
  offload_engine_share                     the engine's own copy (into the window) over its offload
  memcpy_gbps                              dst.copy_(src) of pages * page_bytes contiguous bytes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hicache.client import HiCacheClient  # noqa: E402
from hicache.geometry import model_geometries  # noqa: E402
from hicache.memory import local_buffer  # noqa: E402
from hicache.pools import DeviceKVPool  # noqa: E402

CONFIG = ROOT / "tests" / "fixtures" / "model_configs" / "mimo_v2_flash.json"


def memcpy_s(nbytes: int, repeat: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(pages: int, page_size: int, repeat: int) -> dict[str, Any]:
    with open(CONFIG) as f:
        g = model_geometries(json.load(f), tp_size=1, page_size=page_size, dtype="bfloat16")["full"]
    folder = tempfile.mkdtemp(prefix="hcbench")
    sock = os.path.join(folder, "hc.sock")
    host_gb = 2 * (repeat + 2) * pages * g.page_bytes / 1e9  # both pools, every round's fresh keys
    argv = [sys.executable, "-m", "server", "--socket", sock, "--model-config", str(CONFIG),
            "--page-size", str(page_size), "--kv-cache-dtype", "bfloat16", "--hicache-storage-backend", "none",
            "--hicache-size", f"{host_gb:.3f}", "--log-level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    times: dict[str, list[float]] = {f"{p}_{d}": [] for p in ("engine", "sidecar") for d in ("offload", "reload")}
    shares: list[float] = []
    try:
        assert proc.stdout is not None and "serving on" in proc.stdout.readline()
        private = DeviceKVPool(g, pages, memory=local_buffer(g.pool_bytes(pages)))  # the engine copies
        shared = DeviceKVPool(g, pages)  # shared memory: the sidecar copies
        for dev in (private, shared):
            dev.flat.copy_(torch.randint(0, 256, (dev.nbytes,), dtype=torch.uint8))
        with HiCacheClient(sock, timeout=120) as client:
            pools = {path: client.register(dev, model_id=f"bench-{path}") for path, dev in
                     (("engine", private), ("sidecar", shared))}  # fmt: skip
            copier = client._copiers[pools["engine"].pool_id]
            engine_s: list[float] = []
            write = copier.writer.offload

            def timed(*args: Any, **kw: Any) -> int:
                t0 = time.perf_counter()
                n = write(*args, **kw)
                engine_s.append(time.perf_counter() - t0)
                return n

            copier.writer.offload = timed  # type: ignore[method-assign]
            window = copier.window.num_pages
            for r in range(repeat + 1):  # the first round warms up; the paths alternate
                for path, info in pools.items():
                    keys = client.page_keys([r] * (pages * page_size), pool=info)
                    engine_s.clear()
                    t0 = time.perf_counter()
                    client.offload(keys, list(range(pages)), pool=info)
                    t1 = time.perf_counter()
                    client.reload(keys, list(range(pages)), pool=info)
                    t2 = time.perf_counter()
                    if r:
                        times[f"{path}_offload"].append(t1 - t0)
                        times[f"{path}_reload"].append(t2 - t1)
                        if path == "engine":
                            shares.append(sum(engine_s) / (t1 - t0))
        private.close()
        shared.close()
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    nbytes = pages * g.page_bytes
    base = memcpy_s(nbytes, repeat)
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict[str, Any] = {"pages": pages, "page_bytes": g.page_bytes, "window_pages": window}
    out["memcpy_gbps"] = round(nbytes / base / 1e9, 2)
    for k, v in med.items():
        out[f"{k}_ms"] = round(1e3 * v, 2)
        out[f"{k}_ratio"] = round(base / v, 3)
    out["engine_over_sidecar_offload"] = round(med["engine_offload"] / med["sidecar_offload"], 3)
    out["engine_over_sidecar_reload"] = round(med["engine_reload"] / med["sidecar_reload"], 3)
    out["offload_engine_share"] = round(statistics.median(shares), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run(args.pages, args.page_size, args.repeat)
    print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
