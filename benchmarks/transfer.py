"""Transfer-engine bandwidth as a ratio to a contiguous copy of the same bytes, same process.

    python benchmarks/transfer.py                      # MiMo-V2-Flash full, 256 pages, page 64, bf16, cpu
    python benchmarks/transfer.py --layout page_first --json
    python benchmarks/transfer.py --device cuda        # GPU figures (device pool on CUDA)

Every figure is the median of --repeat runs. Page lists are random (seeded) and unsorted,
drawn from pools twice the transfer size. Ratios:
  offload_ratio / reload_ratio  engine GB/s over memcpy GB/s of the same direction
  naive_ratio                   torch index_select + index_copy_ over token rows (both directions, mean)
  pageN_offload_ratio / pageN_reload_ratio (N = 1, 4, 16)  the same for transfers of N pages
                                (fixed per-call costs), with pageN_*_us the engine's time;
                                on CPU, pageN_*_one_thread_ratio against a memcpy of the same
                                bytes on one thread (numpy's copyto; copy_ uses every core);
                                with the native backend, pageN_*_chunks_ratio is the C copy
                                of exactly those pages' chunks (descriptors made beforehand,
                                one thread) over the engine's time: the share of a call that
                                is the copy itself, pageN_*_chunks_us its time
  layerwise_over_plain          a layer-wise reload (reload_async, wait_layer for every layer,
                                wait) over a plain reload of the same pages: the full transfer,
                                and layerwise_over_plain_1page for one page
  layerwise_busy_over_plain     the layer-wise reload while another Python thread spins,
                                over the plain reload with no such thread (GIL hand-offs, and
                                the core the spinner takes); layerwise_busy_over_plain_busy
                                over the plain reload beside the same spinner (hand-offs only);
                                layerwise_busy_over_plain_1page for one page (goal <= 2), with
                                layerwise_busy_1page_over_1ms the share of those calls that
                                took over 1 ms (a lost GIL costs a switch interval, 5 ms; a
                                spinner that holds the GIL half the time also makes a call
                                wait for its turn about once per 5 ms of the caller's own work)
  cuda_paths                    (CUDA) layer groups copied per path (memcpy, kernel)
  offload_kernel_ratio / reload_kernel_ratio  (CUDA) the Triton kernels of the same transfer
                                launched directly, without the engine (checks, streams,
                                events), over memcpy: what the engine's own costs take away
                                where the engine used the kernels too (cuda_paths "kernel")
--gil-sweep measures instead whether a copy should keep the GIL (the C copy's HOLD_GIL_BYTES):
per size, copies on one thread from and into memory not in cache (a 256 MB span walked
through), alone and beside a spinning Python thread, keeping the GIL and letting go of it:
the median, the mean and the share over 1 ms of each.

memcpy is `dst.copy_(src)` of pages * page_bytes contiguous bytes between the two pools' memory.
With the CPU "native" backend, which writes with streaming (non-temporal) stores, the same
contiguous bytes are also copied by that C code over the same threads ("stream memcpy", the
tighter limit: no read-for-ownership of the destination), and *_stream_ratio compares to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hicache import DeviceKVPool, HostKVPool, KVGeometry, TransferEngine
from hicache.pools import LAYOUTS
from hicache.pools.flat import FlatPool
from hicache.transfer import native
from hicache.transfer.plan import make_plan

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "hicache" / "data" / "mimo_v2_flash.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="HF config.json (default: MiMo-V2-Flash)")
    p.add_argument("--group", default="full", choices=["full", "swa"])
    p.add_argument("--layout", default="layer_first", choices=list(LAYOUTS), help="host pool layout")
    p.add_argument("--pages", type=int, default=256, help="pages per transfer")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--device", default="cpu", help="device pool: cpu or cuda[:N]")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "torch", "triton"])
    p.add_argument("--repeat", type=int, default=7, help="timed runs per figure; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-naive", action="store_true", help="skip the slow index_copy baseline")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--gil-sweep", action="store_true", help="only the measurement of HOLD_GIL_BYTES (see above)")
    args = p.parse_args(argv)
    if args.pages < 1 or args.repeat < 1:
        p.error(f"--pages and --repeat must be >= 1, got {args.pages} and {args.repeat}")
    return args


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], Any], repeat: int, device: str) -> float:
    """Median wall time of fn() over `repeat` runs, after one warm-up run."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def call_seconds(fn: Callable[[], Any], repeat: int) -> list[float]:
    """Wall times of `repeat` calls of fn (CPU), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def interleaved(fns: dict[str, Callable[[], Any]], repeat: int, device: str) -> dict[str, list[float]]:
    """Wall times of each fn over `repeat` rounds, the fns run in turn within a round."""
    for fn in fns.values():
        fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def token_rows(pool: FlatPool, buffer: int) -> torch.Tensor:
    """A [layers, slots, row elements] view of one buffer (slot = page * page_size + token)."""
    g = pool.geometry
    view = pool.chunks(buffer, 0, 0, pool.num_pages, g.layer_num).permute(1, 0, 2, 3)
    rows = view.flatten(1, 2)  # pages and tokens merge: page_stride == page_size * token_stride
    return rows.view(getattr(torch, g.buffers[buffer].storage_dtype))  # the pool's own element type


def naive_copy(src: FlatPool, dst: FlatPool, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
    """The obvious code: gather token rows with index_select, scatter them with index_copy_."""
    ps = src.geometry.page_size
    tok = torch.arange(ps)
    s_slots = (torch.as_tensor(src_pages)[:, None] * ps + tok).flatten()
    d_slots = (torch.as_tensor(dst_pages)[:, None] * ps + tok).flatten()
    s_slots, d_slots = s_slots.to(src.flat.device), d_slots.to(dst.flat.device)
    for b in range(len(src.geometry.buffers)):
        s_rows, d_rows = token_rows(src, b), token_rows(dst, b)
        for layer in range(src.geometry.layer_num):  # per layer: [slots, row] like a pool's k_buffer
            d_rows[layer].index_copy_(0, d_slots, s_rows[layer].index_select(0, s_slots).to(d_rows.device))


def stream_memcpy(src: FlatPool, dst: FlatPool, nbytes: int, threads: int) -> Callable[[], None]:
    """A contiguous copy of the first nbytes through the native path's C copy, on as many
    threads as the engine's copies use."""
    starts = np.arange(0, nbytes, native.MERGE_CAP, dtype=np.int64)
    sizes = np.minimum(native.MERGE_CAP, nbytes - starts)
    descs = np.stack([starts, starts, np.ones_like(starts), sizes, sizes, sizes], axis=1)
    return native.batch_call(src, dst, native.CopyBatch(descs), threads, streaming=True)


def layerwise(engine: TransferEngine, host_pages: np.ndarray, dev_pages: np.ndarray, layers: int) -> None:
    handle = engine.reload_async(host_pages, dev_pages)
    for layer in range(layers):
        handle.wait_layer(layer)
    handle.wait()


class BusyThread:
    """A Python thread that spins (holding the GIL whenever it can) while in the `with` block."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def small_rounds(
    engine: TransferEngine, device: FlatPool, host: FlatPool, d: np.ndarray, h: np.ndarray, reps: int
) -> dict[str, list[float]]:
    """Offload / reload of pages d <-> h, interleaved with memcpy of their bytes and, with
    the native backend, the C copy of exactly the pages' chunks (descriptors built before);
    on CPU, then in rounds of their own, with a one-thread memcpy (the *_one keys)."""
    g = device.geometry
    nbytes = len(d) * g.page_bytes
    dev_bytes, host_bytes = device.flat[:nbytes], host.flat[:nbytes]
    fns = {
        "d2h": lambda: host_bytes.copy_(dev_bytes),
        "offload": lambda: engine.offload(d, h),
        "h2d": lambda: dev_bytes.copy_(host_bytes),
        "reload": lambda: engine.reload(h, d),
    }
    if engine.backend == "native":
        layers = range(g.layer_num)
        to_host = make_plan(d, device.num_pages, h, host.num_pages, g.layer_num)
        to_dev = make_plan(h, host.num_pages, d, device.num_pages, g.layer_num)
        fns["d2h_chunks"] = native.batch_call(device, host, native.descriptors(device, host, to_host, layers), 1)
        fns["h2d_chunks"] = native.batch_call(host, device, native.descriptors(host, device, to_dev, layers), 1)
    rounds = interleaved(fns, reps, "cpu")
    if not device.flat.is_cuda:
        # The same bytes on one thread (numpy), where copy_ uses every core: in rounds of their
        # own, as more time between two copy_ calls lets torch's copy threads fall asleep.
        dev_np, host_np = dev_bytes.numpy(), host_bytes.numpy()
        one = {
            "d2h_one": lambda: np.copyto(host_np, dev_np),
            "offload_one": fns["offload"],
            "h2d_one": lambda: np.copyto(dev_np, host_np),
            "reload_one": fns["reload"],
        }
        rounds.update(interleaved(one, reps, "cpu"))
    return rounds


def layerwise_rounds(engine: TransferEngine, d: np.ndarray, h: np.ndarray, layers: int, reps: int) -> list[float]:
    """Per round: a layer-wise reload's time over a plain reload's, of the same pages."""
    fns = {"plain": lambda: engine.reload(h, d), "layerwise": lambda: layerwise(engine, h, d, layers)}
    rounds = interleaved(fns, reps, "cpu")
    return [lw / p for p, lw in zip(rounds["plain"], rounds["layerwise"], strict=True)]


def fixed_costs(
    engine: TransferEngine, device: FlatPool, host: FlatPool, dev_pages: np.ndarray, host_pages: np.ndarray, repeat: int
) -> dict[str, float]:
    """Small transfers against memcpy of their bytes, and layer-wise over plain reloads (CPU)."""
    g, out = device.geometry, {}
    reps = max(repeat, 20)  # short calls: more rounds for a stable median
    for n in (1, 4, 16):
        if n > len(dev_pages):
            continue
        # the shortest calls swing most on a shared VM: 300 rounds of 1 page (0.2 s), 75 of 4
        rounds = small_rounds(engine, device, host, dev_pages[:n], host_pages[:n], max(reps, 300 // n))
        for name, base in (("offload", "d2h"), ("reload", "h2d")):
            pairs = zip(rounds[base], rounds[name], strict=True)
            out[f"page{n}_{name}_ratio"] = statistics.median(m / e for m, e in pairs)
            out[f"page{n}_{name}_us"] = statistics.median(rounds[name]) * 1e6
            if f"{base}_one" in rounds:
                ones = zip(rounds[f"{base}_one"], rounds[f"{name}_one"], strict=True)
                out[f"page{n}_{name}_one_thread_ratio"] = statistics.median(m / e for m, e in ones)
            if f"{base}_chunks" in rounds:
                chunks = zip(rounds[f"{base}_chunks"], rounds[name], strict=True)
                out[f"page{n}_{name}_chunks_ratio"] = statistics.median(c / e for c, e in chunks)
                out[f"page{n}_{name}_chunks_us"] = statistics.median(rounds[f"{base}_chunks"]) * 1e6
    out["layerwise_over_plain"] = statistics.median(layerwise_rounds(engine, dev_pages, host_pages, g.layer_num, reps))
    one = layerwise_rounds(engine, dev_pages[:1], host_pages[:1], g.layer_num, reps)
    out["layerwise_over_plain_1page"] = statistics.median(one)
    plain = median_seconds(lambda: engine.reload(host_pages, dev_pages), reps, "cpu")
    h1, d1 = host_pages[:1], dev_pages[:1]
    plain_1 = median_seconds(lambda: engine.reload(h1, d1), max(reps, 300), "cpu")
    with BusyThread():
        busy_1 = call_seconds(lambda: layerwise(engine, h1, d1, g.layer_num), max(reps, 300))
    out["layerwise_busy_over_plain_1page"] = statistics.median(busy_1) / plain_1
    out["layerwise_busy_1page_over_1ms"] = sum(t > 1e-3 for t in busy_1) / len(busy_1)
    with BusyThread():
        busy = median_seconds(lambda: layerwise(engine, host_pages, dev_pages, g.layer_num), reps, "cpu")
        plain_busy = median_seconds(lambda: engine.reload(host_pages, dev_pages), reps, "cpu")
    out["layerwise_busy_over_plain"] = busy / plain
    out["layerwise_busy_over_plain_busy"] = busy / plain_busy
    return out


SWEEP_SIZES = (256 << 10, 1 << 20, 1474560, 2 << 20, 2949120, 4 << 20, 5898240, 8 << 20, 16 << 20)
SWEEP_SPAN = 256 << 20  # walked through, so that each copy reads and writes memory not in cache


def gil_sweep(
    sizes: tuple[int, ...] = SWEEP_SIZES, span: int = SWEEP_SPAN, repeat: int = 300
) -> list[dict[str, float]]:
    """Per size: copies on one thread (copy_pieces) alone, and beside a spinning Python thread
    keeping the GIL (hold_gil_bytes above the size) and letting go of it (hold_gil_bytes 0);
    microseconds. The bound is set back afterwards."""
    assert native._native is not None, "the hicache C extension is not built"
    c = native._native
    src = torch.randint(0, 256, (span + max(sizes),), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    before = c.hold_gil_bytes()
    rows = []
    try:
        for nbytes in sizes:
            copy = _walking_copy(src, dst, nbytes, span)
            reps = max(repeat // 4, min(repeat, (repeat << 20) // nbytes))
            c.hold_gil_bytes(nbytes)
            row: dict[str, float] = {"bytes": nbytes, "alone_us": statistics.median(call_seconds(copy, reps)) * 1e6}
            for name, bound in (("held", nbytes), ("released", 0)):
                c.hold_gil_bytes(bound)
                with BusyThread():
                    times = call_seconds(copy, reps)
                row[f"{name}_busy_p50_us"] = statistics.median(times) * 1e6
                row[f"{name}_busy_mean_us"] = statistics.fmean(times) * 1e6
                row[f"{name}_busy_over_1ms"] = sum(t > 1e-3 for t in times) / len(times)
            rows.append(row)
    finally:
        c.hold_gil_bytes(before)
    return rows


def _walking_copy(src: torch.Tensor, dst: torch.Tensor, nbytes: int, span: int) -> Callable[[], None]:
    """A copy of nbytes from src to dst at the next offset of `span` on each call (1 MB pieces)."""
    assert native._native is not None
    c = native._native
    starts = np.arange(0, nbytes, native.MERGE_CAP, dtype=np.int64)
    sizes = np.minimum(native.MERGE_CAP, nbytes - starts)
    base = np.stack([starts, starts, np.ones_like(starts), sizes, sizes, sizes], axis=1)
    variants = []
    for k in range(max(1, span // nbytes)):
        descs = base.copy()
        descs[:, :2] += k * nbytes
        variants.append(np.ascontiguousarray(descs))
    ends = np.array([len(base)], dtype=np.int64)
    head = (dst.data_ptr(), dst.numel(), src.data_ptr(), src.numel())
    turn = iter(range(10**12))

    def copy() -> None:
        c.copy_pieces(*head, variants[next(turn) % len(variants)], ends, 1, False, 1, native.PIECE_BYTES, 0)

    return copy


def sweep_table(rows: list[dict[str, float]]) -> str:
    lines = [
        "copies on one thread, from and into memory not in cache; beside a spinning Python thread:",
        f"{'bytes':>10} {'alone us':>9} | {'held p50':>9} {'mean':>8} {'>1ms':>6} | {'released p50':>12} {'mean':>8} "
        f"{'>1ms':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r['bytes']:>10.0f} {r['alone_us']:9.0f} | {r['held_busy_p50_us']:9.0f} {r['held_busy_mean_us']:8.0f} "
            f"{r['held_busy_over_1ms']:6.3f} | {r['released_busy_p50_us']:12.0f} {r['released_busy_mean_us']:8.0f} "
            f"{r['released_busy_over_1ms']:6.3f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure and return the figures (see the module docstring)."""
    config = json.loads(Path(args.config).read_text())
    g = KVGeometry.from_hf_config(
        config, tp_size=args.tp_size, page_size=args.page_size, dtype=args.dtype, group=args.group
    )
    pool_pages = 2 * args.pages
    device = DeviceKVPool(g, pool_pages, args.device)
    host = HostKVPool(g, pool_pages, args.layout)
    engine = TransferEngine(device, host, args.backend)
    rng = np.random.default_rng(args.seed)
    dev_pages = rng.permutation(pool_pages)[: args.pages]
    host_pages = rng.permutation(pool_pages)[: args.pages]
    nbytes = args.pages * g.page_bytes
    dev_bytes, host_bytes = device.flat[:nbytes], host.flat[:nbytes]
    dev_name = str(device.flat.device)
    # memcpy and engine runs alternate, so that a burst of load elsewhere hits both alike;
    # each ratio is the median of per-round ratios.
    fns: dict[str, Callable[[], Any]] = {
        "d2h": lambda: host_bytes.copy_(dev_bytes),
        "offload": lambda: engine.offload(dev_pages, host_pages),
        "h2d": lambda: dev_bytes.copy_(host_bytes),
        "reload": lambda: engine.reload(host_pages, dev_pages),
    }
    if engine.cuda is not None:  # the kernels alone, without the engine's checks, streams and events
        from hicache.transfer.triton_kernels import copy_pages_triton

        off_plan, rel_plan = engine.offload_plan(dev_pages, host_pages), engine.reload_plan(host_pages, dev_pages)
        fns["offload_kernel"] = lambda: copy_pages_triton(device, host, off_plan)
        fns["reload_kernel"] = lambda: copy_pages_triton(host, device, rel_plan)
    streamed = engine.backend == "native"
    if streamed:
        fns["d2h_stream"] = stream_memcpy(device, host, nbytes, engine.threads)
        fns["h2d_stream"] = stream_memcpy(host, device, nbytes, engine.threads)
    rounds = interleaved(fns, args.repeat, dev_name)
    gb = nbytes / 1e9
    med = {k: statistics.median(v) for k, v in rounds.items()}
    out: dict[str, Any] = {
        "offload_gbps": gb / med["offload"],
        "reload_gbps": gb / med["reload"],
        "memcpy_gbps": gb / statistics.median(rounds["d2h"] + rounds["h2d"]),
        "memcpy_d2h_gbps": gb / med["d2h"],
        "memcpy_h2d_gbps": gb / med["h2d"],
        "offload_ratio": statistics.median(m / e for m, e in zip(rounds["d2h"], rounds["offload"], strict=True)),
        "reload_ratio": statistics.median(m / e for m, e in zip(rounds["h2d"], rounds["reload"], strict=True)),
    }
    if streamed:
        out["stream_memcpy_d2h_gbps"] = gb / med["d2h_stream"]
        out["stream_memcpy_h2d_gbps"] = gb / med["h2d_stream"]
        for name, base in (("offload", "d2h_stream"), ("reload", "h2d_stream")):
            pairs = zip(rounds[base], rounds[name], strict=True)
            out[f"{name}_stream_ratio"] = statistics.median(m / e for m, e in pairs)
    if engine.cuda is not None:  # which CUDA path copied the layer groups; the kernels alone
        out["cuda_paths"] = dict(engine.cuda.paths)
        for name, base in (("offload", "d2h"), ("reload", "h2d")):
            pairs = zip(rounds[base], rounds[f"{name}_kernel"], strict=True)
            out[f"{name}_kernel_ratio"] = statistics.median(m / e for m, e in pairs)
    if not args.device.startswith("cuda"):
        out.update(fixed_costs(engine, device, host, dev_pages, host_pages, args.repeat))
    t_d2h, t_h2d = med["d2h"], med["h2d"]
    if not args.no_naive:
        naive_repeat = max(1, min(3, args.repeat))
        t_noff = median_seconds(lambda: naive_copy(device, host, dev_pages, host_pages), naive_repeat, dev_name)
        t_nrel = median_seconds(lambda: naive_copy(host, device, host_pages, dev_pages), naive_repeat, dev_name)
        out["naive_offload_ratio"] = t_d2h / t_noff
        out["naive_reload_ratio"] = t_h2d / t_nrel
        out["naive_ratio"] = (out["naive_offload_ratio"] + out["naive_reload_ratio"]) / 2
    out.update(
        geometry=g.to_dict(),
        page_bytes=g.page_bytes,
        transfer_bytes=nbytes,
        layout=args.layout,
        pages=args.pages,
        page_size=args.page_size,
        device=args.device,
        backend=engine.backend,
        repeat=args.repeat,
        torch_threads=torch.get_num_threads(),
    )
    return out


def table(r: dict[str, Any]) -> str:
    g = r["geometry"]
    head = (
        f"{r['pages']} pages x {r['page_bytes'] / 1e6:.2f} MB ({r['transfer_bytes'] / 1e6:.0f} MB), "
        f"{g['layer_num']} layers, {g['dtype']}, host {r['layout']}, device {r['device']} "
        f"(backend {r['backend']}), median of {r['repeat']}"
    )
    stream = "offload_stream_ratio" in r
    rows = [
        ("memcpy device->host", r["memcpy_d2h_gbps"], 1.0, None),
        ("memcpy host->device", r["memcpy_h2d_gbps"], 1.0, None),
    ]
    if stream:
        rows.append(("stream memcpy dev->host", r["stream_memcpy_d2h_gbps"], None, 1.0))
        rows.append(("stream memcpy host->dev", r["stream_memcpy_h2d_gbps"], None, 1.0))
    rows.append(("offload (engine)", r["offload_gbps"], r["offload_ratio"], r.get("offload_stream_ratio")))
    rows.append(("reload (engine)", r["reload_gbps"], r["reload_ratio"], r.get("reload_stream_ratio")))
    lines = [head, f"{'':24} {'GB/s':>8} {'ratio':>7}" + (f" {'vs stream':>10}" if stream else "")]
    for name, gbps, ratio, vs_stream in rows:
        line = f"{name:24} {gbps:8.2f} " + (f"{ratio:7.3f}" if ratio is not None else " " * 7)
        lines.append(line + (f" {vs_stream:10.3f}" if vs_stream is not None else ""))
    if "naive_ratio" in r:
        lines.append(f"{'naive index_copy (mean)':24} {'':8} {r['naive_ratio']:7.3f}")
    for n in (1, 4, 16):
        if f"page{n}_offload_ratio" in r:
            lines.append(
                f"{n:>2}-page offload / reload: {r[f'page{n}_offload_us']:.0f} / {r[f'page{n}_reload_us']:.0f} us, "
                f"ratio {r[f'page{n}_offload_ratio']:.3f} / {r[f'page{n}_reload_ratio']:.3f}"
                + (
                    f"; the chunks' C copy alone {r[f'page{n}_offload_chunks_us']:.0f} / "
                    f"{r[f'page{n}_reload_chunks_us']:.0f} us"
                    if f"page{n}_offload_chunks_us" in r
                    else ""
                )
            )
    if "layerwise_over_plain" in r:
        lines.append(
            f"layer-wise / plain reload: {r['layerwise_over_plain']:.2f} (1 page {r['layerwise_over_plain_1page']:.2f}); "
            f"with a busy Python thread: {r['layerwise_busy_over_plain']:.2f} "
            f"({r['layerwise_busy_over_plain_busy']:.2f} over a plain reload beside it); 1 page beside it over "
            f"a plain one alone {r['layerwise_busy_over_plain_1page']:.2f} (goal <= 2), "
            f"{100 * r['layerwise_busy_1page_over_1ms']:.1f}% of them over 1 ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gil_sweep:
        if not native.available():
            print("transfer benchmark: error: --gil-sweep needs the C extension", file=sys.stderr)
            return 2
        rows = gil_sweep()
        print(json.dumps(rows) if args.json else sweep_table(rows))
        return 0
    try:
        result = run(args)
    except ValueError as exc:
        print(f"transfer benchmark: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
