"""vLLM's offloading calls through hicache's worker: submit_store / submit_load of a batch of
blocks, waited for, in GB/s and as a ratio to a plain memcpy of the same bytes in the same run.

    .venv-vllm/bin/python benchmarks/vllm_offload.py            # or: make bench-vllm
    .venv-vllm/bin/python benchmarks/vllm_offload.py --json

The engine side is vLLM's own: a KVCacheConfig of Qwen3-8B's FullAttentionSpec (36 layers,
8 KV heads of 128, bf16), one memfd allocation viewed by create_kv_cache_views, the
OffloadingConfig of build_offloading_config, and the CanonicalKVCaches that vLLM's
OffloadingConnectorWorker hands to the spec. hicache-server runs as its own process on a
Unix socket and maps vLLM's allocation, so each store/load is one copy between vLLM's
blocks and the sidecar's host pool (host memory only: --storage none). Figures:
  store_gbps / load_gbps   block bytes / wall time of submit + wait (RPC included)
  memcpy_gbps              one contiguous copy_ of the same number of bytes
  store_ratio, load_ratio  the two above over memcpy_gbps (median of per-round ratios)
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

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "tests" / "integrations" / "vllm_offload"):
    sys.path.insert(0, str(p))

import torch  # noqa: E402
import vllm_env  # noqa: E402
from sidecar_util import start_sidecar  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=64, help="blocks per job")
    p.add_argument("--block-size", type=int, default=16, help="tokens per vLLM block")
    p.add_argument("--layout", default="LBNHC", choices=["LBNHC", "BLNHC"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n = args.blocks
    sockdir = tempfile.mkdtemp(prefix="hc")
    tmp = Path(tempfile.mkdtemp(prefix="hc-vllm-"))
    config = vllm_env.FIXTURES / "qwen3_8b.json"
    extra = ["--hicache-storage-backend", "none", "--hicache-ratio", "2"]
    proc, target = start_sidecar(sockdir, *extra, config=config, page_size=args.block_size)
    try:
        vc = vllm_env.vllm_config(vllm_env.model_dir(tmp, "qwen3_8b"), target, timeout_s=60)
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(vc.model_config.get_num_layers(vc.parallel_config))]
        spec = vllm_env.attention_spec(vc, block=args.block_size)
        eng = vllm_env.make_engine(vc, [(spec, layers)], num_blocks=2 * n, layout=args.layout)
        vllm_env.fill(eng, seed=1)
        vllm_env.start_worker(eng)
        manager, worker = eng.spec.get_manager(), eng.worker
        link = worker.links[0]
        host_pages = worker.client.stats(link.pool_id)[0].host_pages
        nbytes = n * link.geometry.page_bytes
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        a.random_(0, 255)
        ctx, rows = ReqContext(req_id="bench"), []
        src = GPULoadStoreSpec(list(range(n)), group_sizes=[n], block_indices=[0])
        dst = GPULoadStoreSpec(list(range(n, 2 * n)), group_sizes=[n], block_indices=[0])
        for r in range(args.rounds + 1):
            keys = [make_offload_key(r.to_bytes(4, "big") + i.to_bytes(28, "big"), 0) for i in range(n)]
            with manager.lock:
                out = manager.prepare_store(keys, ctx)
            t0 = time.perf_counter()
            b.copy_(a)
            t1 = time.perf_counter()
            worker.submit_store(2 * r, src, out.store_spec)
            worker.wait({2 * r})
            t2 = time.perf_counter()
            with manager.lock:
                load_spec = manager.prepare_load(keys, ctx)
            t3 = time.perf_counter()
            worker.submit_load(2 * r + 1, load_spec, dst)
            worker.wait({2 * r + 1})
            t4 = time.perf_counter()
            results = worker.get_finished()
            assert all(x.success for x in results) and len(results) == 2, results
            assert all(torch.equal(eng.block(layers[-1], i), eng.block(layers[-1], n + i)) for i in (0, n - 1))
            with manager.lock:
                manager.complete_load(keys, ctx)
            worker.client.evict(num_pages=host_pages, pool=link.pool_id)  # room for the next round
            if r:  # round 0 warms up
                rows.append(
                    {
                        "memcpy": nbytes / (t1 - t0) / 1e9,
                        "store": nbytes / (t2 - t1) / 1e9,
                        "load": nbytes / (t4 - t3) / 1e9,
                    }
                )
        med = {k: statistics.median(row[k] for row in rows) for k in ("memcpy", "store", "load")}
        out_json = {
            "layout": args.layout,
            "blocks": n,
            "block_bytes": link.geometry.page_bytes,
            "batch_mb": nbytes / 1e6,
            "memcpy_gbps": med["memcpy"],
            "store_gbps": med["store"],
            "load_gbps": med["load"],
            "store_ratio": statistics.median(row["store"] / row["memcpy"] for row in rows),
            "load_ratio": statistics.median(row["load"] / row["memcpy"] for row in rows),
        }
        manager.shutdown()
        eng.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(sockdir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(out_json))
    else:
        o = out_json
        print(
            f"vLLM offloading worker, Qwen3-8B (36 x 8 x 128, bf16), {args.layout}, {n} blocks x {o['block_bytes']} B"
        )
        print(f"  memcpy            {o['memcpy_gbps']:6.2f} GB/s")
        print(f"  submit_store      {o['store_gbps']:6.2f} GB/s   ratio {o['store_ratio']:.2f}")
        print(f"  submit_load       {o['load_gbps']:6.2f} GB/s   ratio {o['load_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    sys.exit(main())
