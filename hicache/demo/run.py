"""`hicache demo`: a sidecar and an example engine, as two processes, serving a multi-turn chat.

Without --sidecar it starts `hicache-server` on a socket in a temporary folder (its storage
tier there too) and runs the engine in this process against it; with --sidecar TARGET it
runs only the engine, against a sidecar that is already up (compose's `engine` service).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from dataclasses import asdict

import torch

from hicache.api import PoolStats
from hicache.client import HiCacheClient
from hicache.client.health import SERVING, check_health
from hicache.demo.configs import load_config, model_geometries, truncate_layers
from hicache.demo.engine import DemoEngine
from hicache.demo.model import ToyModel
from hicache.demo.report import Progress, Tally, summary
from hicache.demo.sidecar import SidecarProcess
from hicache.demo.workload import ChatWorkload
from hicache.geometry import KVGeometry
from hicache.pools import DeviceKVPool


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's flags (sizes default to a run of about 30 s on 2 cores)."""
    m = p.add_argument_group("model")
    m.add_argument("--config", help="HF config.json (default: the bundled MiMo-V2-Flash config)")
    m.add_argument("--layers", type=int, default=0, help="keep the model's first N layers (0: all)")
    m.add_argument("--tp-size", type=int, default=1)
    m.add_argument("--page-size", type=int, default=16)
    m.add_argument("--dtype", default="bfloat16", help="KV dtype: bfloat16, float16, float32, fp8_e4m3, fp8_e5m2")
    w = p.add_argument_group("workload")
    w.add_argument("--conversations", type=int, default=6)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--system-tokens", type=int, default=40, help="shared system prompt length")
    w.add_argument("--turn-tokens", default="28,52", help="LO,HI tokens added per turn")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("sizes and the sidecar")
    s.add_argument("--device-pages", type=int, default=0, help="engine pool pages (0: the longest request + 2)")
    s.add_argument("--hicache-ratio", type=float, default=2.0, help="host pages per device page")
    s.add_argument("--hicache-size", type=float, default=0.0, help="host pool GB per group (0: use the ratio)")
    s.add_argument("--hicache-mem-layout", default="layer_first")
    s.add_argument("--hicache-storage-backend", default="file", help="file, redis or none")
    s.add_argument(
        "--hicache-storage-backend-extra-config",
        default="",
        help='JSON for the backend (default for file: {"dir": <temp folder>/storage})',
    )
    s.add_argument("--hicache-write-policy", default="write_through")
    s.add_argument("--hicache-storage-prefetch-policy", default="best_effort")
    s.add_argument("--sidecar", default=None, metavar="TARGET", help="use this running sidecar (socket path or target)")
    s.add_argument(
        "--token", default=os.environ.get("HICACHE_TOKEN"), help="the sidecar's token (default $HICACHE_TOKEN)"
    )
    s.add_argument("--namespace", default="", help="key namespace (default: a fresh one per run)")
    s.add_argument("--report-json", default=None, help="also write the counters to this JSON file")


def _turn_tokens(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--turn-tokens must be LO,HI, got {text!r}") from None
    return lo, hi


def sidecar_args(args: argparse.Namespace, config_path: str, workdir: str) -> list[str]:
    """Flags for a sidecar that expects exactly this demo's geometry."""
    out = ["--model-config", config_path, "--tp-size", str(args.tp_size), "--page-size", str(args.page_size)]
    out += ["--kv-cache-dtype", args.dtype, "--hicache-ratio", str(args.hicache_ratio)]
    out += ["--hicache-size", str(args.hicache_size), "--hicache-mem-layout", args.hicache_mem_layout]
    extra = args.hicache_storage_backend_extra_config
    if not extra and args.hicache_storage_backend == "file":
        extra = json.dumps({"dir": os.path.join(workdir, "storage")})
    out += ["--hicache-storage-backend", args.hicache_storage_backend, "--hicache-storage-backend-extra-config", extra]
    out += ["--hicache-write-policy", args.hicache_write_policy]
    out += ["--hicache-storage-prefetch-policy", args.hicache_storage_prefetch_policy]
    out += ["--log-level", "WARNING"]
    return out


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 if every check passed, 1 if one failed. Raises ValueError for bad flags."""
    # The model's matrices are tiny: one thread beats a team that fights the sidecar for 2 cores.
    torch.set_num_threads(1)
    config = load_config(args.config)
    if args.layers:
        config = truncate_layers(config, args.layers)
    geometries = model_geometries(config, tp_size=args.tp_size, page_size=args.page_size, dtype=args.dtype)
    inner = config.get("text_config") or config
    window = inner.get("sliding_window") if "swa" in geometries else None
    model = ToyModel(geometries, window=window, seed=args.seed)
    workload = ChatWorkload(
        args.conversations, args.turns, args.system_tokens, _turn_tokens(args.turn_tokens), seed=args.seed
    )
    max_pages = -(-workload.max_tokens // args.page_size)
    device_pages = args.device_pages or max_pages + 2
    with tempfile.TemporaryDirectory(prefix="hicache-demo-") as workdir:
        sidecar = None
        target = args.sidecar
        if target is None:
            config_path = os.path.join(workdir, "config.json")
            with open(config_path, "w") as f:
                json.dump(config, f)
            sidecar = SidecarProcess(sidecar_args(args, config_path, workdir), workdir)
        started = False
        try:
            if sidecar is not None:
                sidecar.wait_ready()
                target = sidecar.target
            else:
                _check_serving(target)
            started = True
            assert target is not None
            return _run_engine(args, target, geometries, model, workload, device_pages, max_pages)
        finally:
            if sidecar is not None:
                rc = sidecar.stop()
                if rc != 0 and started:  # a refusal at start was already reported
                    print(f"sidecar exited with status {rc}:\n{sidecar.log_tail()}", file=sys.stderr)


def _check_serving(target: str | None) -> None:
    """Raises ValueError, within seconds, unless a sidecar serves at `target` (--sidecar)."""
    if target is None:
        raise ValueError("no sidecar to connect to")
    status = check_health(target, timeout=3.0)
    if status != SERVING:
        raise ValueError(f"no sidecar serving at {target}: {status}")


def _run_engine(
    args: argparse.Namespace,
    target: str,
    geometries: dict[str, KVGeometry],
    model: ToyModel,
    workload: ChatWorkload,
    device_pages: int,
    max_pages: int,
) -> int:
    namespace = args.namespace or f"demo-{secrets.token_hex(4)}"
    requests = workload.requests()
    tally = Tally()
    pools = {name: DeviceKVPool(g, device_pages) for name, g in geometries.items()}
    client = HiCacheClient(target, token=args.token, timeout=120)
    engine = None
    try:
        pool_ids = {}
        for name, pool in pools.items():
            info = client.register(pool, namespace=namespace, model_id="hicache-demo", group=name)
            pool_ids[name] = info.pool_id
        engine = DemoEngine(client, pools, pool_ids, model, tally, max_request_pages=max_pages)
        groups = ", ".join(
            f"{n} {g.layer_num} layers K{g.head_dim}/V{g.v_head_dim} x{g.head_num} heads" for n, g in geometries.items()
        )
        page_mb = sum(g.page_bytes for g in geometries.values()) / 1e6
        print(
            f"hicache demo: engine pid {os.getpid()} -> sidecar {target}\n  groups: {groups}\n"
            f"  {len(requests)} requests; {device_pages} device pages of {page_mb:.2f} MB (all groups)",
            flush=True,
        )
        progress = Progress(len(requests))
        t0 = time.perf_counter()
        for i, req in enumerate(requests):
            engine.serve(req.tokens)
            saved = tally.tokens - tally.computed_tokens
            progress.update(i + 1, f"saved {100 * saved / max(tally.tokens, 1):.0f}%")
        progress.close()
        elapsed = time.perf_counter() - t0
        stats: list[PoolStats] = [client.stats(pool=pid)[0] for pid in pool_ids.values()]
        print(summary(tally, stats, elapsed))
        if args.report_json:
            with open(args.report_json, "w") as f:
                report = {**asdict(tally), "failures": tally.failures(), "notices": tally.notices()}
                json.dump({**report, "elapsed_s": elapsed}, f)
        return 1 if tally.failures() else 0
    finally:
        if engine is not None:
            engine.close()
        client.close()
        for pool in pools.values():
            pool.close()
