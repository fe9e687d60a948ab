"""SGLang's real classes for the adapter tests, or a skip (a failure where the environment is
required: HICACHE_REQUIRE_ENGINES=sglang, as `make test-sglang` and CI set it)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "model_configs"
NEEDED = "SGLang is not installed here: run `make test-sglang` (it builds .venv-sglang with `make sglang-env`)"


def require_sglang() -> None:
    try:
        import sglang  # noqa: F401
    except ImportError:
        if "sglang" in os.environ.get("HICACHE_REQUIRE_ENGINES", ""):
            raise
        pytest.skip(NEEDED, allow_module_level=True)
    import torchvision_standin

    torchvision_standin.install()


def model_dir(tmp: Path, name: str) -> str:
    """A model folder holding the fixture config as config.json (SGLang's model_name)."""
    d = tmp / name
    d.mkdir(exist_ok=True)
    shutil.copy(FIXTURES / f"{name}.json", d / "config.json")
    return str(d)


def sidecar_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def storage_config(
    model_name: str,
    target: str,
    *,
    layout: str,
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
    mla: bool = False,
    **extra: Any,
) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    cfg = {
        "backend_name": "hicache",
        "module_path": "hicache.integrations.sglang",
        "class_name": "HiCacheSidecarStorage",
        "interface_v1": 1,
        "target": target,
        # the first registration loads torch in the sidecar: seconds on a busy 2-core machine,
        # past which start-up would take the sidecar for down
        "timeout_s": 60,
        **extra,
    }
    return HiCacheStorageConfig(
        tp_rank=tp[0],
        tp_size=tp[1],
        pp_rank=pp[0],
        pp_size=pp[1],
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",
        model_name=model_name,
        extra_config=cfg,
    )


def mha_host_pool(
    layers: int,
    heads: int,
    k_dim: int,
    v_dim: int,
    *,
    layout: str,
    pages: int = 8,
    page: int = 16,
    allocator: str = "default",
    start_layer: int = 0,
    dtype: str = "bfloat16",
) -> Any:
    """A real SGLang MHA host pool (get_mha_host_pool_cls picks the K != V class) on CPU;
    allocator "shm" puts it in memfds, as SGLang's "allocator": "shm" extra config does.
    start_layer: the model layer of its first layer (a pipeline stage's; SGLang's end_layer
    is then start_layer + layers). dtype: the device pool's storage dtype (SGLang stores fp8
    caches as "uint8")."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    dev_tokens = 4 * page
    store = getattr(torch, dtype)
    k = tuple(torch.zeros(dev_tokens + page, heads, k_dim, dtype=store) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens + page, heads, v_dim, dtype=store) for _ in range(layers))

    def ptrs(ts: tuple[Any, ...]) -> Any:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=page,
        head_num=heads,
        head_dim=k_dim,
        v_head_dim=v_dim,
        dtype=store,
        device=torch.device("cpu"),
    )
    cls = get_mha_host_pool_cls(info)
    pool = cls(
        info, 2.0, 0, page, layout, pin_memory=False, device="cpu", allocator_type=allocator,
        device_capacity_tokens=dev_tokens, start_layer=start_layer, end_layer=start_layer + layers,
        host_token_capacity=pages * page,
    )  # fmt: skip
    pool._keep = (k, v)  # the device tensors the pointer tables name
    return pool


def mla_host_pool(
    layers: int,
    *,
    layout: str,
    rank: int = 512,
    rope: int = 64,
    pages: int = 8,
    page: int = 16,
    allocator: str = "default",
) -> Any:
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dev_tokens = 4 * page
    bufs = tuple(torch.zeros(dev_tokens + page, 1, rank + rope, dtype=torch.bfloat16) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page, kv_lora_rank=rank,
        qk_rope_head_dim=rope, kv_cache_dim=rank + rope, dtype=torch.bfloat16, device=torch.device("cpu"),
    )  # fmt: skip
    pool = MLATokenToKVPoolHost(
        info, 2.0, 0, page, layout, pin_memory=False, device="cpu", allocator_type=allocator,
        device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers, target_layer_num=layers,
        host_token_capacity=pages * page,
    )  # fmt: skip
    pool._keep = bufs
    return pool


def create(storage_cfg: Any, host_pool: Any) -> Any:
    """What SGLang's controller does: the factory, then register_mem_pool_host."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", storage_cfg, host_pool)
    backend.register_mem_pool_host(host_pool)
    return backend


def fill(pool: Any, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    for buf in (pool.kv_buffer,) if getattr(pool, "k_buffer", None) is None else (pool.k_buffer, pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))


def page_bytes(pool: Any, page: int) -> bytes:
    """Host page `page` as raw bytes, read where SGLang's own get_page_buffer_meta says the
    page lives (its regions cover the page exactly, in every layout)."""
    import ctypes

    import torch

    slots = torch.arange(page * pool.page_size, (page + 1) * pool.page_size)
    ptrs, sizes = pool.get_page_buffer_meta(slots)
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))


def sglang_rows(pool: Any, layer: int, page: int) -> list[Any]:
    """K and V (or the MLA latent) of one layer of one host page, [page_size, heads, dim],
    indexed the way SGLang's pools are shaped (written out per layout, independently of the
    adapter's layouts). MHA pools have k_buffer and v_buffer (kv_buffer[0] and [1])."""
    p, lay = pool.page_size, pool.layout
    s = slice(page * p, (page + 1) * p)
    bufs = [pool.kv_buffer] if hasattr(pool, "kv_lora_rank") else [pool.k_buffer, pool.v_buffer]
    if lay == "layer_first":  # [L, slots, ...]
        return [b[layer, s] for b in bufs]
    if lay == "page_first":  # [slots, L, ...]
        return [b[s, layer] for b in bufs]
    return [b[page, layer] for b in bufs]  # page_first_direct: [pages, L, P, ...]


def keys_for(tokens: list[int], page: int = 16) -> list[str]:
    from sglang.srt.mem_cache.utils import get_hash_str

    return list(get_hash_str(tokens, None, page_size=page))
