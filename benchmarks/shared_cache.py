"""Two engines, one sidecar, one shared prefix: the host bytes it takes and the second engine's
reload time, with the engines sharing one host cache (one model) and, for comparison, not
sharing it (each engine its own model id, so each offloads its own copy).

    python benchmarks/shared_cache.py               # MiMo-V2-Flash full group, page 64, bf16, 64 pages
    python benchmarks/shared_cache.py --pages 128 --json

The sidecar runs as its own process (`python -m server`, no storage tier) on a temporary Unix
socket; the two engines are two clients in this process, each with a CPU DeviceKVPool in
shared memory. Engine A offloads the prefix; then each engine reloads it --iters times into
its own device pages (A: its own pages back; B: the pages A offloaded, when shared).
  host_bytes          host bytes holding the prefix (the used pages of every distinct host
                      cache x page bytes), and over one copy of the prefix in host_copies
  first_reload_s      median wall time of A's Reload of the whole prefix
  second_reload_s     the same for B; second_over_first (goal: about 1: a shared page is an
                      ordinary host page to B)
  memcpy_s            one contiguous copy of the prefix's bytes in this process; the reloads
                      over it in *_over_memcpy
  second_offload_s    unshared only: B's Offload of its own copy of the prefix, the work a
                      shared cache saves
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
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from hicache import DeviceKVPool  # noqa: E402
from hicache.client import HiCacheClient  # noqa: E402
from hicache.client.health import check_health  # noqa: E402
from hicache.demo import load_config  # noqa: E402
from hicache.geometry import KVGeometry, model_geometries  # noqa: E402
from hicache.keys import page_keys  # noqa: E402

MODEL = "bench-model@rev1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pages", type=int, default=64, help="pages of the shared prefix")
    p.add_argument("--iters", type=int, default=10, help="reloads per engine")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.pages < 1 or args.iters < 1:
        p.error(f"--pages and --iters must be >= 1, got {args.pages} and {args.iters}")
    return args


def geometry(page_size: int) -> KVGeometry:
    return model_geometries(load_config(None), tp_size=1, page_size=page_size, dtype="bfloat16")["full"]


def start_sidecar(sock: str, page_size: int, host_pages: int, device_pages: int) -> subprocess.Popen[bytes]:
    ratio = host_pages / device_pages
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--socket", sock, "--page-size", str(page_size), "--log-level", "WARNING"]
        + ["--hicache-ratio", str(ratio), "--hicache-storage-backend", "none"],
        cwd=ROOT,
        stdout=sys.stderr,  # keep this process's stdout for the report (--json must parse)
    )
    deadline = time.monotonic() + 120
    while check_health(f"unix://{sock}") != "SERVING":
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the sidecar did not start")
        time.sleep(0.1)
    return proc


def timed(fn: Any, iters: int) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run(args: argparse.Namespace, g: KVGeometry, sock: str, shared: bool) -> dict[str, Any]:
    n = args.pages
    keys = page_keys(
        torch.randint(0, 150000, (n * g.page_size,), generator=torch.Generator().manual_seed(1)).numpy(), g.page_size
    )
    a_dev, b_dev = DeviceKVPool(g, n), DeviceKVPool(g, n)
    for dev, seed in ((a_dev, 1), (b_dev, 2)):
        gen = torch.Generator().manual_seed(seed)
        for layer in range(g.layer_num):
            for buf in dev.layer_buffers(layer):
                buf.copy_(torch.randn(buf.shape, generator=gen))
    pages = list(range(n))
    a, b = HiCacheClient(f"unix://{sock}", timeout=60), HiCacheClient(f"unix://{sock}", timeout=60)
    try:
        pa = a.register(a_dev, model_id=MODEL)
        pb = b.register(b_dev, model_id=MODEL if shared else MODEL + "-b")
        for client, info in ((a, pa), (b, pb)):  # a host pool takes its memory in the background
            while client.stats(info.pool_id)[0].host_pages < info.host_pages:
                time.sleep(0.05)
        assert all(s.value == "stored" for s in a.offload(keys, pages, pool=pa.pool_id).statuses)
        row: dict[str, Any] = {}
        if not shared:
            t0 = time.perf_counter()
            assert all(s.value == "stored" for s in b.offload(keys, pages, pool=pb.pool_id).statuses)
            row["second_offload_s"] = time.perf_counter() - t0
        want = [(a_dev if shared else b_dev).read_page(p).clone() for p in pages]  # what B must read back
        first = timed(lambda: a.reload(keys, pages, pool=pa.pool_id), args.iters)
        second = timed(lambda: b.reload(keys, pages, pool=pb.pool_id), args.iters)
        assert all(torch.equal(b_dev.read_page(p), w) for p, w in zip(pages, want, strict=True))  # bit-exact
        stats = [*a.stats(pa.pool_id), *b.stats(pb.pool_id)]
        caches = {s.cache_id: s.used_pages for s in stats}
        host_bytes = sum(caches.values()) * g.page_bytes
        row.update(
            host_bytes=host_bytes,
            host_copies=host_bytes / (n * g.page_bytes),
            host_caches=len(caches),
            first_reload_s=first,
            second_reload_s=second,
            second_over_first=second / first,
        )
        return row
    finally:
        a.close()
        b.close()
        a_dev.close()
        b_dev.close()


def memcpy_s(nbytes: int, iters: int) -> float:
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    return timed(lambda: dst.copy_(src), max(iters, 5))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    g = geometry(args.page_size)
    sockdir = tempfile.mkdtemp(prefix="hcs")
    sock = os.path.join(sockdir, "hc.sock")
    server = start_sidecar(sock, args.page_size, host_pages=2 * args.pages + 8, device_pages=args.pages)
    report: dict[str, Any] = {
        "geometry": f"MiMo-V2-Flash full, K {g.head_dim} / V {g.v_head_dim}, page {g.page_size}",
        "prefix_bytes": args.pages * g.page_bytes,
    }
    try:
        report["memcpy_s"] = memcpy_s(args.pages * g.page_bytes, args.iters)
        for name, shared in (("shared", True), ("unshared", False)):
            row = run(args, g, sock, shared)
            row["first_over_memcpy"] = row["first_reload_s"] / report["memcpy_s"]
            row["second_over_memcpy"] = row["second_reload_s"] / report["memcpy_s"]
            report[name] = row
        report["host_bytes_shared_over_unshared"] = report["shared"]["host_bytes"] / report["unshared"]["host_bytes"]
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(sockdir, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{report['geometry']}; prefix {args.pages} pages, {report['prefix_bytes'] / 1e6:.1f} MB; memcpy {report['memcpy_s'] * 1e3:.2f} ms"
    )
    for name in ("shared", "unshared"):
        r = report[name]
        print(
            f"{name:9s} host {r['host_bytes'] / 1e6:7.1f} MB ({r['host_copies']:.1f} copies, {r['host_caches']} caches)  "
            f"reload A {r['first_reload_s'] * 1e3:6.2f} ms  B {r['second_reload_s'] * 1e3:6.2f} ms  "
            f"B/A {r['second_over_first']:.2f}  B/memcpy {r['second_over_memcpy']:.2f}"
            + (f"  B's own offload {r['second_offload_s'] * 1e3:.2f} ms" if "second_offload_s" in r else "")
        )
    print(f"host bytes shared / unshared: {report['host_bytes_shared_over_unshared']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
