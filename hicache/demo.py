"""`hicache demo`: offload KV pages to the host pool, wipe the device, reload into other
pages, and verify every page byte for byte and every attention output exactly."""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources
from typing import Any

import numpy as np
import torch

from hicache.geometry import KVGeometry
from hicache.hf_config import model_geometries
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.transfer import TransferEngine


def load_config(path: str | None) -> dict[str, Any]:
    """An HF config.json as a dict; the bundled MiMo-V2-Flash config when path is None."""
    if path is None:
        return json.loads(resources.files("hicache.data").joinpath("mimo_v2_flash.json").read_text())
    with open(path) as f:
        return json.load(f)


def print_geometry(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    for group, g in model_geometries(config, tp_size=args.tp_size, page_size=args.page_size, dtype=args.dtype).items():
        print(
            f"[{group}] {g.attention} layers={g.layer_num} heads={g.head_num} head_dim={g.head_dim} "
            f"v_head_dim={g.v_head_dim} dtype={g.dtype} k_row_bytes={g.k_row_bytes} "
            f"v_row_bytes={g.v_row_bytes} token_bytes={g.token_bytes} page_bytes={g.page_bytes} "
            f"fingerprint={g.fingerprint}"
        )
    return 0


def _attention(pool: DeviceKVPool, layer: int, slots: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    k = pool.k_buffer(layer)[slots].float()
    if pool.geometry.is_mla:  # attend over the latent; the latent is also the value
        k = k[..., : pool.geometry.kv_lora_rank]
        v = k
    else:
        v = pool.v_buffer(layer)[slots].float()
    q = q[..., : k.shape[-1]]
    scores = torch.einsum("hd,thd->ht", q.expand(k.shape[1], -1), k) / k.shape[-1] ** 0.5
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v)


def _slots(g: KVGeometry, pages: np.ndarray) -> torch.Tensor:
    return torch.cat([torch.arange(int(p) * g.page_size, (int(p) + 1) * g.page_size) for p in pages])


def run_demo(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    geometries = model_geometries(config, tp_size=args.tp_size, page_size=args.page_size, dtype=args.dtype)
    rng = np.random.default_rng(args.seed)
    n = min(args.device_pages // 2, args.host_pages)
    failures = 0
    rows = []
    for group, g in geometries.items():
        dev = DeviceKVPool(g, args.device_pages)
        host = HostKVPool(g, args.host_pages, args.layout)
        engine = TransferEngine(dev, host)
        gen = torch.Generator().manual_seed(args.seed)
        dev.flat.copy_(torch.randint(0, 256, (dev.nbytes,), dtype=torch.uint8, generator=gen))
        if g.dtype in ("bfloat16", "float16", "float32"):  # finite values, so attention is meaningful
            for layer in range(g.layer_num):
                for buf in dev.layer_buffers(layer)[: 1 if g.is_mla else 2]:
                    buf.copy_(torch.randn(buf.shape, generator=gen))
        src_pages = rng.permutation(args.device_pages)[:n]
        host_pages = rng.permutation(args.host_pages)[:n]
        dst_pages = rng.permutation(args.device_pages)[:n]
        check_attention = g.dtype in ("bfloat16", "float16", "float32")
        q = torch.randn(max(g.head_dim or 1, 1), generator=gen)
        before_pages = [
            dev.chunks(b, int(p), 0, 1, g.layer_num).clone() for p in src_pages for b in range(len(g.buffers))
        ]
        before_attn = (
            [_attention(dev, layer, _slots(g, src_pages), q) for layer in range(g.layer_num)] if check_attention else []
        )

        t0 = time.perf_counter()
        moved_out = engine.offload(src_pages, host_pages)
        t1 = time.perf_counter()
        dev.flat.zero_()
        t2 = time.perf_counter()
        moved_in = engine.reload(host_pages, dst_pages)
        t3 = time.perf_counter()

        after_pages = [dev.chunks(b, int(p), 0, 1, g.layer_num) for p in dst_pages for b in range(len(g.buffers))]
        bad_pages = sum(not torch.equal(a, b) for a, b in zip(before_pages, after_pages, strict=True))
        after_attn = (
            [_attention(dev, layer, _slots(g, dst_pages), q) for layer in range(g.layer_num)] if check_attention else []
        )
        bad_attn = sum(not torch.equal(a, b) for a, b in zip(before_attn, after_attn, strict=True))
        dev.check_integrity()
        host.check_integrity()
        failures += bad_pages + bad_attn
        rows.append(
            (
                group,
                g,
                n,
                moved_out / (t1 - t0) / 1e9,
                moved_in / (t3 - t2) / 1e9,
                bad_pages,
                bad_attn,
                len(before_attn),
            )
        )
        dev.close()
        host.close()

    print(f"hicache demo: {config.get('architectures', ['?'])[0]}, layout {args.layout}, page_size {args.page_size}")
    header = f"{'group':6} {'layers':>6} {'K/V dim':>9} {'page KiB':>9} {'pages':>6} {'offload GB/s':>13} {'reload GB/s':>12} {'pages ok':>9} {'attn ok':>8}"
    print(header)
    print("-" * len(header))
    for group, g, pages, out_gbps, in_gbps, bad_pages, bad_attn, attn in rows:
        dims = f"{g.head_dim}/{g.v_head_dim}"
        print(
            f"{group:6} {g.layer_num:>6} {dims:>9} {g.page_bytes / 1024:>9.0f} {pages:>6} {out_gbps:>13.2f} "
            f"{in_gbps:>12.2f} {pages * len(g.buffers) - bad_pages:>4}/{pages * len(g.buffers):<4} "
            f"{attn - bad_attn:>3}/{attn:<3}"
        )
    print("verified: all pages bit-exact" if failures == 0 else f"FAILED: {failures} mismatches")
    return 0 if failures == 0 else 1
