"""`hicache demo`: a sidecar and an example engine, as two processes, serving a multi-turn chat.

Without --sidecar it starts `hicache-server` on a socket in a temporary folder (its storage
tier there too) and runs the engine in this process against it; with --sidecar TARGET it
runs only the engine, against a sidecar that is already up (compose's `engine` service).
With --nodes N it runs N engines, each with its own sidecar (own host pool), over one shared
storage tier, and routes each conversation's turns to the nodes in turn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict

import torch

from hicache.api import PoolStats
from hicache.client import HiCacheClient
from hicache.client.health import SERVING, check_health
from hicache.demo.configs import load_config, model_geometries, truncate_layers
from hicache.demo.engine import DemoEngine
from hicache.demo.model import ToyModel
from hicache.demo.redis_cluster import LocalRedisCluster
from hicache.demo.report import Progress, Tally, summary
from hicache.demo.sidecar import SidecarProcess
from hicache.demo.workload import ChatWorkload
from hicache.geometry import KVGeometry
from hicache.pools import DeviceKVPool
from hicache.validate import is_int


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
    s.add_argument(
        "--hicache-size", type=float, default=0.0, help="host GB of each sidecar, split among its pools (0: the ratio)"
    )
    s.add_argument("--hicache-mem-layout", default="layer_first")
    s.add_argument("--hicache-storage-backend", default="file", help="file, redis, redis-cluster or none")
    s.add_argument(
        "--hicache-storage-backend-extra-config",
        default="",
        help='JSON for the backend (default for file: {"dir": <temp folder>/storage})',
    )
    s.add_argument("--hicache-write-policy", default="write_through")
    s.add_argument("--hicache-storage-prefetch-policy", default="best_effort")
    s.add_argument(
        "--sidecar",
        default=None,
        metavar="TARGET",
        help="use this running sidecar (socket path or target; with --nodes N, N of them, comma-separated)",
    )
    s.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="engines, each with its own sidecar, sharing the storage tier (redis or redis-cluster: "
        "without a url, a local 3+3 Redis Cluster is started)",
    )
    s.add_argument(
        "--token", default=os.environ.get("HICACHE_TOKEN"), help="the sidecar's token (default $HICACHE_TOKEN)"
    )
    s.add_argument("--namespace", default="", help="key namespace (default: a fresh one per run)")
    s.add_argument(
        "--require-cross-node-hits",
        action="store_true",
        help="fail unless some prompt tokens came from pages another engine stored (a second node)",
    )
    s.add_argument("--report-json", default=None, help="also write the counters to this JSON file")


@contextlib.contextmanager
def local_cluster(workdir: str) -> Iterator[LocalRedisCluster]:
    """A 3-master, 3-replica Redis Cluster in workdir. Raises ValueError when redis-server is missing."""
    try:
        cluster = LocalRedisCluster(os.path.join(workdir, "redis-cluster"))
    except FileNotFoundError as exc:
        raise ValueError(
            f"--hicache-storage-backend redis-cluster without a url starts a local cluster: {exc}"
        ) from None
    with cluster:
        print(f"hicache demo: local Redis Cluster at {', '.join(cluster.urls[:3])} (3 masters, 3 replicas)", flush=True)
        yield cluster


def _turn_tokens(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--turn-tokens must be LO,HI, got {text!r}") from None
    return lo, hi


def sidecar_args(
    args: argparse.Namespace, config_path: str, workdir: str, stack: contextlib.ExitStack | None = None
) -> list[str]:
    """Flags for a sidecar that expects exactly this demo's geometry. A redis-cluster backend
    without a url gets a local cluster in `workdir` (stopped by `stack`)."""
    out = ["--model-config", config_path, "--tp-size", str(args.tp_size), "--page-size", str(args.page_size)]
    out += ["--kv-cache-dtype", args.dtype, "--hicache-ratio", str(args.hicache_ratio)]
    out += ["--hicache-size", str(args.hicache_size), "--hicache-mem-layout", args.hicache_mem_layout]
    extra = args.hicache_storage_backend_extra_config
    if not extra and args.hicache_storage_backend == "file":
        extra = json.dumps({"dir": os.path.join(workdir, "storage")})
    if not extra and args.hicache_storage_backend == "redis-cluster" and stack is not None:
        extra = json.dumps({"url": stack.enter_context(local_cluster(workdir)).url})
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
    targets = _check_nodes(args)
    with tempfile.TemporaryDirectory(prefix="hicache-demo-") as workdir, contextlib.ExitStack() as stack:
        sidecars: list[SidecarProcess] = []
        started = False
        try:
            if not targets:
                config_path = os.path.join(workdir, "config.json")
                with open(config_path, "w") as f:
                    json.dump(config, f)
                flags = sidecar_args(args, config_path, workdir, stack)
                for node in range(args.nodes):
                    folder = os.path.join(workdir, f"node{node}") if args.nodes > 1 else workdir
                    os.makedirs(folder, exist_ok=True)
                    sidecars.append(SidecarProcess(flags, folder))
                for sidecar in sidecars:
                    sidecar.wait_ready()
                targets = [s.target for s in sidecars]
            else:
                for target in targets:
                    _check_serving(target)
            started = True
            return _run_engines(args, targets, geometries, model, workload, device_pages, max_pages)
        finally:
            for sidecar in sidecars:
                rc = sidecar.stop()
                if rc != 0 and started:  # a refusal at start was already reported
                    print(f"sidecar exited with status {rc}:\n{sidecar.log_tail()}", file=sys.stderr)


SHARED_BACKENDS = ("redis", "redis-cluster")


def _check_nodes(args: argparse.Namespace) -> list[str]:
    """The --sidecar targets (one per node), [] to start the sidecars here. Raises ValueError
    for a node count the flags cannot serve."""
    if not is_int(args.nodes) or args.nodes < 1:
        raise ValueError(f"--nodes must be an int >= 1, got {args.nodes!r}")
    targets = [t for t in (args.sidecar or "").split(",") if t]
    if targets and len(targets) != args.nodes:
        raise ValueError(f"--nodes {args.nodes} needs {args.nodes} comma-separated --sidecar targets, got {targets}")
    if args.nodes > 1 and not targets and args.hicache_storage_backend not in SHARED_BACKENDS:
        raise ValueError(
            f"--nodes {args.nodes} needs a storage backend the nodes share ({' or '.join(SHARED_BACKENDS)}), "
            f"got {args.hicache_storage_backend!r}"
        )
    return targets


def _check_serving(target: str | None) -> None:
    """Raises ValueError, within seconds, unless a sidecar serves at `target` (--sidecar)."""
    if target is None:
        raise ValueError("no sidecar to connect to")
    status = check_health(target, timeout=10.0)  # a missing sidecar answers UNAVAILABLE at once
    if status != SERVING:
        raise ValueError(f"no sidecar serving at {target}: {status}")


class _Node:
    """One engine and its sidecar."""

    def __init__(self, target: str, args: argparse.Namespace, geometries: dict[str, KVGeometry], device_pages: int):
        self.target = target
        self.pools = {name: DeviceKVPool(g, device_pages) for name, g in geometries.items()}
        self.client = HiCacheClient(target, token=args.token, timeout=120)
        self.pool_ids: dict[str, str] = {}
        self.engine: DemoEngine | None = None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.client.close()
        for pool in self.pools.values():
            pool.close()


def _run_engines(
    args: argparse.Namespace,
    targets: list[str],
    geometries: dict[str, KVGeometry],
    model: ToyModel,
    workload: ChatWorkload,
    device_pages: int,
    max_pages: int,
) -> int:
    """Serve the workload on one engine per target; a conversation's turns go to the nodes in
    turn (turn t of conversation c to node (c + t) % nodes), as a router that ignores the
    cache would send them, so its prefix must come over the shared storage tier."""
    namespace = args.namespace or f"demo-{secrets.token_hex(4)}"
    requests = workload.requests()
    tally = Tally(require_cross_node=args.require_cross_node_hits)
    ledger: dict[tuple[str, bytes], bytes] = {}
    nodes: list[_Node] = []
    try:
        for target in targets:
            node = _Node(target, args, geometries, device_pages)
            nodes.append(node)
            for name, pool in node.pools.items():
                info = node.client.register(pool, namespace=namespace, model_id="hicache-demo", group=name)
                node.pool_ids[name] = info.pool_id
            node.engine = DemoEngine(
                node.client, node.pools, node.pool_ids, model, tally, max_request_pages=max_pages, ledger=ledger
            )
        groups = ", ".join(
            f"{n} {g.layer_num} layers K{g.head_dim}/V{g.v_head_dim} x{g.head_num} heads" for n, g in geometries.items()
        )
        page_mb = sum(g.page_bytes for g in geometries.values()) / 1e6
        print(
            f"hicache demo: engine pid {os.getpid()} -> sidecar {', '.join(targets)}\n  groups: {groups}\n"
            f"  {len(requests)} requests; {device_pages} device pages of {page_mb:.2f} MB (all groups)",
            flush=True,
        )
        progress = Progress(len(requests))
        t0 = time.perf_counter()
        for i, req in enumerate(requests):
            engine = nodes[(req.conversation + req.turn) % len(nodes)].engine
            assert engine is not None
            engine.serve(req.tokens)
            saved = tally.tokens - tally.computed_tokens
            progress.update(i + 1, f"saved {100 * saved / max(tally.tokens, 1):.0f}%")
        progress.close()
        elapsed = time.perf_counter() - t0
        stats: list[PoolStats] = [n.client.stats(pool=pid)[0] for n in nodes for pid in n.pool_ids.values()]
        print(summary(tally, stats, elapsed, nodes=len(nodes)))
        if args.report_json:
            with open(args.report_json, "w") as f:
                report = {**asdict(tally), "failures": tally.failures(), "notices": tally.notices()}
                json.dump({**report, "elapsed_s": elapsed, "nodes": len(nodes)}, f)
        return 1 if tally.failures() else 0
    finally:
        for node in nodes:
            node.close()
