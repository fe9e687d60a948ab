"""The KVGeometry of each vLLM KV-cache group, and the check that vLLM's pages have its size.

A page of a group is one vLLM block (tokens_per_block tokens) of every layer of the group.
vLLM keeps a layer's block as [H, N, C] cells of C = (head_size + head_size_v) * dtype bytes;
the sidecar copies that block as bytes. So what the handshake can check is the geometry's
fields (heads, head dims, dtype, page size, layer count) and that they give exactly the
bytes vLLM allocates per block; the order of bytes inside a block is vLLM's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hicache.geometry import KVGeometry, model_geometries, normalize_dtype
from hicache.hf_config import geometry_kwargs

_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def dtype_name(dtype: Any) -> str:
    """hicache's name of a torch dtype or a vLLM cache dtype string ("bfloat16", "fp8")."""
    return normalize_dtype(str(dtype).removeprefix("torch."))


def geometry_from_spec(
    spec: Any,
    layer_num: int,
    layer_ids: Sequence[int] | None = None,
    hf_config: dict[str, Any] | None = None,
) -> KVGeometry:
    """The geometry of `layer_num` layers of one vLLM AttentionSpec (FullAttentionSpec,
    SlidingWindowSpec, MLAAttentionSpec, ...). An MLA spec's head_size is the whole latent
    row; its split into kv_lora_rank + qk_rope_head_dim comes from the model's `hf_config`
    (required for MLA), and must add up to it. Raises ValueError for that, and for a spec
    whose pages hold more than K and V rows (quantization scales, packed cells)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, KVQuantMode, MLAAttentionSpec

    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"hicache offloads attention KV caches only, not {type(spec).__name__}")
    packed = spec.kv_quant_mode != KVQuantMode.NONE or spec.num_head_slots is not None
    if packed or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        raise ValueError(f"{type(spec).__name__} with packed or quantized cells has no hicache geometry: {spec}")
    ids = tuple(layer_ids) if layer_ids is not None else None
    if isinstance(spec, MLAAttentionSpec):
        rank, rope = mla_split(hf_config, spec.head_size)
        return KVGeometry(
            attention="mla",
            layer_num=layer_num,
            head_num=1,
            kv_lora_rank=rank,
            qk_rope_head_dim=rope,
            page_size=spec.block_size,
            dtype=dtype_name(spec.dtype),
            layer_ids=ids,
        )
    return KVGeometry(
        layer_num=layer_num,
        head_num=spec.num_kv_heads,
        head_dim=spec.head_size,
        v_head_dim=spec.head_size_v,
        page_size=spec.block_size,
        dtype=dtype_name(spec.dtype),
        layer_ids=ids,
    )


def mla_split(hf_config: dict[str, Any] | None, head_size: int) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim) from the model's HF config, checked to add up to the
    latent width vLLM allocates (its MLA spec's head_size). Raises ValueError."""
    if hf_config is None:
        raise ValueError(f"an MLA KV cache (latent width {head_size}) needs the model config for its split")
    found = geometry_kwargs(hf_config, tp_size=1, page_size=1, dtype="bfloat16", group="full")
    if found["attention"] != "mla":
        raise ValueError(f"vLLM's KV cache is MLA (latent width {head_size}), the model config is not")
    rank, rope = found["kv_lora_rank"], found["qk_rope_head_dim"]
    if rank + rope != head_size:
        raise ValueError(
            f"model config kv_lora_rank {rank} + qk_rope_head_dim {rope} = {rank + rope}, "
            f"but vLLM's MLA latent width (head_size) is {head_size}"
        )
    return rank, rope


def layer_ids_of(layer_names: Sequence[str]) -> tuple[int, ...] | None:
    """The model layer numbers in vLLM's layer names ("model.layers.3.self_attn.attn"), or
    None when a name holds none."""
    ids = [_LAYER_ID.search(n) for n in layer_names]
    return tuple(int(m.group(1)) for m in ids if m) if all(ids) else None


def geometry_from_hf(
    hf_config: dict[str, Any], *, sliding: bool, layer_names: Sequence[str], tp_size: int, page_size: int, dtype: str
) -> KVGeometry:
    """A group's geometry from the model's HF config: the "swa" group's per-layer shape for a
    sliding-window group, else the "full" one, over the group's own layers (vLLM may split
    a hybrid model's layers into several groups). Raises ValueError."""
    groups = model_geometries(hf_config, tp_size=tp_size, page_size=page_size, dtype=dtype_name(dtype))
    name = "swa" if sliding else "full"
    if name not in groups:
        raise ValueError(f"vLLM has a {name!r} KV-cache group, the model config has only {sorted(groups)}")
    return replace(groups[name], layer_num=len(layer_names), layer_ids=layer_ids_of(layer_names))


def sliding_in_model(hf_config: dict[str, Any], layer_ids: Sequence[int] | None) -> bool:
    """Whether the model config makes every one of `layer_ids` a sliding-window layer (none
    for a model without an "swa" group, or layers of unknown ids). Raises ValueError for a
    config hicache cannot read."""
    swa = model_geometries(hf_config, tp_size=1, page_size=1, dtype="bfloat16").get("swa")
    if swa is None or not layer_ids:
        return False
    return set(layer_ids) <= set(swa.layer_ids or ())


def check_page_bytes(geometry: KVGeometry, page_bytes: Sequence[int], group: int) -> bool:
    """Whether vLLM packs the group's layers into one region per block (a block-outermost
    layout gives one ref of every layer's page); raises ValueError unless vLLM's pages (the
    unpadded bytes per block of each ref) are exactly the geometry's."""
    want = geometry.page_bytes_for(1)
    if len(page_bytes) == 1 and geometry.layer_num > 1 and page_bytes[0] == geometry.page_bytes:
        return True
    if len(page_bytes) != geometry.layer_num:
        raise ValueError(f"vLLM group {group}: {len(page_bytes)} layers, the geometry has {geometry.layer_num}")
    wrong = sorted({b for b in page_bytes if b != want})
    if wrong:
        raise ValueError(
            f"vLLM group {group}: blocks of {wrong} bytes per layer, but {geometry} gives {want}; "
            "the model config does not describe this KV cache"
        )
    return False
