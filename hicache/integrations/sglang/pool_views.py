"""SGLang host pools: the KVGeometry they hold, and the memory that holds each of its buffers.

SGLang 0.5.23's host pools (sglang.srt.mem_cache.pool_host), per layout:
  MHA, K = V dims:  kv_buffer [2, slots, L, H, D] (page_first), [2, pages, L, P, H, D]
                    (page_first_direct), [2, L, slots, H, D] (layer_first)
  MHA, K != V dims: k_buffer / v_buffer, two allocations, each [slots, L, H, D] or
                    [pages, L, P, H, D] (page_first / page_first_direct only)
  MLA:              kv_buffer [slots, L, 1, C], [pages, L, P, 1, C] or [L, slots, 1, C]
Each buffer (K, V, or the MLA latent) is one region of hicache's EngineLayout
"sglang_<layout>" (hicache.pools.layouts), which addresses it by strides; host_segments()
names the tensor of each. A flat page (get_data_page(flat=True)) is the same layout over
one page, each buffer's rows back to back.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from hicache.geometry import KVGeometry
from hicache.integrations.sglang.options import FP8_SETTING_NAMES

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_DTYPES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
# SGLang keeps every fp8 cache in uint8 storage, so a uint8 pool's format comes from SGLang's
# --kv-cache-dtype ("auto" is uint8 only for an FP8 checkpoint, whose cache is e4m3)
_FP8_SETTINGS = {"auto": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def is_mla(pool: Any) -> bool:
    return hasattr(pool, "kv_lora_rank")


def check_layout(pool: Any) -> str:
    layout = getattr(pool, "layout", None)
    if layout not in LAYOUTS:
        raise ValueError(
            f"SGLang host pool layout {layout!r} is not supported by hicache; "
            f"start SGLang with --hicache-mem-layout one of {list(LAYOUTS)}"
        )
    return str(layout)


def host_segments(pool: Any) -> list[torch.Tensor]:
    """The tensor that holds each buffer of SGLang host pool `pool`, in KVGeometry.buffers
    order: K and V (views of one kv_buffer, or SGLang's two allocations when K != V), or the
    MLA latent. Raises ValueError for an unsupported layout."""
    check_layout(pool)
    if is_mla(pool):
        return [pool.kv_buffer]
    return [pool.k_buffer, pool.v_buffer]  # kv_buffer[0] and [1]: one tensor, or two (K != V)


def fp8_setting(option: str | None, sglang: str | None) -> str | None:
    """Which --kv-cache-dtype names a uint8 pool's fp8 format: the adapter's `option`, else
    SGLang's own setting `sglang` (None where neither is known). Raises ValueError when both
    are known fp8 settings of different formats."""
    if option is None:
        return sglang
    if sglang in _FP8_SETTINGS and _FP8_SETTINGS[sglang] != _FP8_SETTINGS[option]:
        raise ValueError(
            f"extra config 'kv_cache_dtype' {option!r} names another fp8 format than SGLang's "
            f"--kv-cache-dtype {sglang!r} ({_FP8_SETTINGS[sglang]})"
        )
    return option


def uint8_dtype(kv_cache_dtype: str | None) -> str:
    """The hicache dtype of a uint8 SGLang pool: which fp8 it holds, from SGLang's
    --kv-cache-dtype setting (None: unknown). Raises ValueError where that is unknown or not an
    fp8 format hicache holds: taking e4m3 for e5m2 (or ROCm's e4m3fnuz) would decode every
    page wrongly, with no error."""
    if torch.version.hip:
        raise ValueError("SGLang on ROCm stores fp8 KV caches as float8_e4m3fnuz, which hicache does not hold")
    if kv_cache_dtype is None:
        raise ValueError(
            "SGLang's host pool stores an fp8 KV cache as uint8, and which fp8 it is (e4m3 or e5m2) "
            f"is unknown here: set 'kv_cache_dtype' (one of {list(FP8_SETTING_NAMES)}) in "
            "--hicache-storage-backend-extra-config, as SGLang's --kv-cache-dtype"
        )
    dtype = _FP8_SETTINGS.get(kv_cache_dtype)
    if dtype is None:
        raise ValueError(
            f"SGLang's host pool stores uint8 with --kv-cache-dtype {kv_cache_dtype!r}; hicache holds uint8 "
            f"pools of {list(FP8_SETTING_NAMES)} only"
        )
    return dtype


def geometry_of(
    pool: Any, *, layer_ids: tuple[int, ...] | None = None, kv_cache_dtype: str | None = None
) -> KVGeometry:
    """The KVGeometry of SGLang host pool `pool` (its own fields: heads, head dims or MLA
    widths, layers, page size, dtype). layer_ids: the model's layer ids of this pool's layers
    (default start_layer .. end_layer). kv_cache_dtype: SGLang's --kv-cache-dtype, which names
    the fp8 format of a uint8 pool (see uint8_dtype). Raises ValueError for what hicache
    cannot hold."""
    check_layout(pool)
    dtype = uint8_dtype(kv_cache_dtype) if pool.dtype == torch.uint8 else _DTYPES.get(pool.dtype)
    if dtype is None:
        raise ValueError(
            f"SGLang host pool dtype {pool.dtype} is not one hicache stores; expected one of "
            f"{[*_DTYPES, torch.uint8]} (uint8: fp8)"
        )
    start = getattr(pool, "start_layer", 0) or 0
    ids = layer_ids if layer_ids is not None else tuple(range(start, start + pool.layer_num))
    if is_mla(pool):
        return KVGeometry(
            attention="mla",
            layer_num=pool.layer_num,
            head_num=1,
            kv_lora_rank=pool.kv_lora_rank,
            qk_rope_head_dim=pool.qk_rope_head_dim,
            page_size=pool.page_size,
            dtype=dtype,
            layer_ids=ids,
        )
    v_dim = getattr(pool, "v_head_dim", None) or pool.head_dim
    return KVGeometry(
        layer_num=pool.layer_num,
        head_num=pool.head_num,
        head_dim=pool.head_dim,
        v_head_dim=v_dim,
        page_size=pool.page_size,
        dtype=dtype,
        layer_ids=ids,
    )


def stage_geometry(pool: Any, model: KVGeometry) -> KVGeometry:
    """`model` (one KV group of the model config) cut to the layers that SGLang host pool
    `pool` holds. With pipeline parallelism a stage's pool holds layer_num of the group's
    layers from its start_layer on; they are counted, not spanned, because a hybrid model's
    group has its layers among the other group's. Raises ValueError when fewer lie there."""
    assert model.layer_ids is not None  # KVGeometry fills it
    start = getattr(pool, "start_layer", 0) or 0
    ids = tuple(i for i in sorted(model.layer_ids) if i >= start)[: pool.layer_num]
    if len(ids) < pool.layer_num:
        raise ValueError(
            f"SGLang host pool holds {pool.layer_num} layers from layer {start}, but the model config has "
            f"{len(ids)} of this group's layers from there (the group's layers: {model.layer_ids})"
        )
    return replace(model, layer_num=len(ids), layer_ids=ids)
