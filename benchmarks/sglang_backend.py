"""SGLang's storage calls through hicache's adapter: batch_set_v1 / batch_get_v1 GB/s for
128-page batches, as a ratio to a plain memcpy of the same bytes in the same run.

    .venv-sglang/bin/python benchmarks/sglang_backend.py            # or: make bench-sglang
    .venv-sglang/bin/python benchmarks/sglang_backend.py --json

SGLang's real host pool (MiMo-V2-Flash full group, K 192 / V 128, the asymmetric pool SGLang
uses for K != V) over CPU memory, its real factory and keys; hicache-server as its own process
on a Unix socket, host memory only (--storage none, the default) or with the file tier.
Paths (one copy each way on both): --allocator shm (SGLang's "allocator": "shm", memfds): the
sidecar maps SGLang's pool and copies straight between it and its host pool ("direct", copy
path "sidecar"); --allocator default: this process maps the sidecar's host pool and copies
between it and SGLang's host buffers (copy path "engine"; before it, "staging" copied through a
staging pool, two copies each way). Figures:
  set_gbps / get_gbps   page bytes / wall time of one batch_set_v1 / batch_get_v1 (RPC included)
  memcpy_gbps           one contiguous copy_ of the same number of bytes
  set_ratio, get_ratio  the two above over memcpy_gbps (median of per-round ratios)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "tests" / "integrations" / "sglang_backend"):
    sys.path.insert(0, str(p))

import sglang_env  # noqa: E402
import torch  # noqa: E402
import torchvision_standin  # noqa: E402  (tests/integrations/sglang_backend)
from sidecar_util import start_sidecar  # noqa: E402

torchvision_standin.install()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=128, help="pages per call (SGLang sends 128)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--layout", default="page_first", choices=["page_first", "page_first_direct"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--storage", default="none", choices=["none", "file"])
    p.add_argument(
        "--allocator",
        default="both",
        choices=["both", "shm", "default"],
        help="shm: SGLang's memfd host pool (the sidecar copies); default: this process copies (engine); both: each",
    )
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    allocators = ["shm", "default"] if args.allocator == "both" else [args.allocator]
    for allocator in allocators:
        out = measure(args, allocator)
        if args.json:
            print(json.dumps(out))
        else:
            print(
                f"SGLang adapter ({out['path']}), MiMo-V2-Flash full K192/V128, {args.layout}, "
                f"{out['pages']} pages x {out['page_bytes']} B, storage {args.storage}"
            )
            print(f"  memcpy            {out['memcpy_gbps']:6.2f} GB/s")
            print(f"  batch_set_v1      {out['set_gbps']:6.2f} GB/s   ratio {out['set_ratio']:.2f}")
            print(f"  batch_get_v1      {out['get_gbps']:6.2f} GB/s   ratio {out['get_ratio']:.2f}")
    return 0


def measure(args: argparse.Namespace, allocator: str) -> dict[str, Any]:
    """One path's figures, with its own sidecar and SGLang host pool."""
    from hicache.geometry import model_geometries

    config_path = sglang_env.FIXTURES / "mimo_v2_flash.json"
    g = model_geometries(json.loads(config_path.read_text()), tp_size=1, page_size=args.page_size, dtype="bf16")["full"]
    sockdir = tempfile.mkdtemp(prefix="hc")
    tmp = Path(tempfile.mkdtemp(prefix="hc-sgl-"))
    extra = ["--hicache-storage-backend", args.storage, "--hicache-ratio", "4"]
    proc, target = start_sidecar(sockdir, *extra, config=config_path, page_size=args.page_size)
    try:
        n = args.pages
        pool = sglang_env.mha_host_pool(
            g.layer_num,
            g.head_num,
            g.head_dim,
            g.v_head_dim,
            layout=args.layout,
            pages=2 * n,
            page=args.page_size,
            allocator=allocator,
        )
        cfg = sglang_env.storage_config(
            sglang_env.model_dir(tmp, "mimo_v2_flash"),
            target,
            layout=args.layout,
            timeout_s=60,
            allocator=allocator,
        )
        backend = sglang_env.create(cfg, pool)
        sglang_env.fill(pool, seed=1)
        src, dst = pool.alloc(n * args.page_size), pool.alloc(n * args.page_size)
        nbytes = n * g.page_bytes
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        a.random_(0, 255)
        rows: list[dict[str, float]] = []
        for r in range(args.rounds + 1):
            keys = sglang_env.keys_for(
                list(range(r * n * args.page_size, (r + 1) * n * args.page_size)), args.page_size
            )
            t0 = time.perf_counter()
            b.copy_(a)
            t1 = time.perf_counter()
            ok_set = backend.batch_set_v1(keys, src)
            t2 = time.perf_counter()
            ok_get = backend.batch_get_v1(keys, dst)
            t3 = time.perf_counter()
            assert all(ok_set) and all(ok_get), (sum(ok_set), sum(ok_get))
            if r:  # round 0 warms up
                rows.append(
                    {
                        "memcpy": nbytes / (t1 - t0) / 1e9,
                        "set": nbytes / (t2 - t1) / 1e9,
                        "get": nbytes / (t3 - t2) / 1e9,
                    }
                )
            link = backend.links["kv"]
            backend.client.evict(num_pages=link.host_pages, pool=link.pool_id)  # room for the next round
        assert sglang_env.page_bytes(pool, int(dst[0]) // args.page_size) == sglang_env.page_bytes(
            pool, int(src[0]) // args.page_size
        )
        med = {k: statistics.median(row[k] for row in rows) for k in ("memcpy", "set", "get")}
        out = {
            "path": "direct" if backend.links["kv"].direct else "engine",
            "layout": args.layout,
            "storage": args.storage,
            "pages": n,
            "page_bytes": g.page_bytes,
            "batch_mb": nbytes / 1e6,
            "memcpy_gbps": med["memcpy"],
            "set_gbps": med["set"],
            "get_gbps": med["get"],
            "set_ratio": statistics.median(row["set"] / row["memcpy"] for row in rows),
            "get_ratio": statistics.median(row["get"] / row["memcpy"] for row in rows),
        }
        backend.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(sockdir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    sys.exit(main())
