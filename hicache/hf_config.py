"""Reading a Hugging Face config.json into KVGeometry fields.

Rules:
- `text_config` is used when present (multimodal wrappers); it must be a dict.
- Sizes, where present, are ints >= 1 (qk_rope_head_dim >= 0); an explicit 0 is an error,
  never a default.
- head_dim: `head_dim`, else hidden_size / num_attention_heads (which must divide it).
  v_head_dim: `v_head_dim`, else head_dim.
- MLA when `kv_lora_rank` is present: one latent row of kv_lora_rank + qk_rope_head_dim
  (both required), head_num 1, replicated on every TP rank.
- dtype "auto": torch_dtype (or dtype) of the config, else of its text_config; bfloat16
  when neither has one or it is not bfloat16, float16 or float32.
- KV heads: the first present of num_key_value_heads, num_attention_heads; per rank
  max(1, kv // tp), valid only when tp divides kv or kv divides tp.
- Sliding-window layers ("swa" group): hybrid_layer_pattern[i] == 1, or
  layer_types[i] == "sliding_attention", or (i + 1) % sliding_window_pattern != 0.
  use_sliding_window: false means none. The swa group reads swa_num_key_value_heads,
  swa_head_dim and swa_v_head_dim when present. Layers of other types in layer_types
  (linear attention, mamba) hold no KV cache and belong to neither group.
"""

from __future__ import annotations

import json
import os
from typing import Any, TypeVar

from hicache.validate import is_int

GROUPS = ("full", "swa")
_FULL_TYPES = ("full_attention", "attention", "global_attention")
T = TypeVar("T")


def geometry_kwargs(config: dict[str, Any], *, tp_size: int, page_size: int, dtype: str, group: str) -> dict[str, Any]:
    """KVGeometry keyword arguments for one group of `config`. Raises ValueError."""
    cfg = _text_config(config)
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    if not is_int(tp_size) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    dtype = _resolve_auto(dtype, config, cfg)
    layer_num = _req_int(cfg, "num_hidden_layers")

    if cfg.get("kv_lora_rank") is not None:
        if group != "full":
            raise ValueError(f"group {group!r} does not exist in an MLA model; it has only 'full'")
        return dict(
            attention="mla",
            layer_num=layer_num,
            layer_ids=tuple(range(layer_num)),
            head_num=1,
            kv_lora_rank=_req_int(cfg, "kv_lora_rank"),
            qk_rope_head_dim=_req_int(cfg, "qk_rope_head_dim", minimum=0),
            page_size=page_size,
            dtype=dtype,
        )

    full_ids, swa_ids = _split_layers(cfg, layer_num)
    ids = full_ids if group == "full" else swa_ids
    if not ids:
        raise ValueError(f"group {group!r} has no layers in this model (model type {cfg.get('model_type')!r})")

    attn_heads = _opt_int(cfg, "num_attention_heads")
    head_dim = _opt_int(cfg, "head_dim")
    if head_dim is None:
        if attn_heads is None:
            raise ValueError("config has neither head_dim nor num_attention_heads")
        hidden = _req_int(cfg, "hidden_size")
        if hidden % attn_heads:
            raise ValueError(f"config hidden_size {hidden} is not a multiple of num_attention_heads {attn_heads}")
        head_dim = hidden // attn_heads
    v_head_dim = _or(_opt_int(cfg, "v_head_dim"), head_dim)
    kv_heads = _or(_opt_int(cfg, "num_key_value_heads"), attn_heads)
    if kv_heads is None:
        raise ValueError("config has neither num_key_value_heads nor num_attention_heads")
    if group == "swa":
        kv_heads = _or(_opt_int(cfg, "swa_num_key_value_heads"), kv_heads)
        swa_head_dim = _opt_int(cfg, "swa_head_dim")
        if swa_head_dim is not None:
            v_head_dim, head_dim = swa_head_dim, swa_head_dim
        v_head_dim = _or(_opt_int(cfg, "swa_v_head_dim"), v_head_dim)
    return dict(
        attention="mha",
        layer_num=len(ids),
        layer_ids=tuple(ids),
        head_num=_heads_per_rank(kv_heads, tp_size),
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        page_size=page_size,
        dtype=dtype,
    )


def _heads_per_rank(kv_heads: int, tp_size: int) -> int:
    if kv_heads < 1:
        raise ValueError(f"num_key_value_heads must be >= 1, got {kv_heads}")
    if tp_size % kv_heads and kv_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} and {kv_heads} KV heads: one must divide the other")
    return max(1, kv_heads // tp_size)


def _split_layers(cfg: dict[str, Any], layer_num: int) -> tuple[list[int], list[int]]:
    """(full-attention layer ids, sliding-window layer ids)."""
    layers = range(layer_num)
    if cfg.get("use_sliding_window") is False:
        return list(layers), []
    pattern = cfg.get("hybrid_layer_pattern")
    if pattern is not None:
        _check_len("hybrid_layer_pattern", pattern, layer_num)
        return [i for i in layers if pattern[i] != 1], [i for i in layers if pattern[i] == 1]
    types = cfg.get("layer_types")
    if types is not None:
        _check_len("layer_types", types, layer_num)
        full = [i for i in layers if types[i] in _FULL_TYPES]
        return full, [i for i in layers if types[i] == "sliding_attention"]
    every = cfg.get("sliding_window_pattern")
    if every is not None:
        if not is_int(every) or every < 1:
            raise ValueError(f"sliding_window_pattern must be an int >= 1, got {every!r}")
        return [i for i in layers if (i + 1) % every == 0], [i for i in layers if (i + 1) % every]
    return list(layers), []


def _text_config(config: Any) -> dict[str, Any]:
    """The dict that describes the language model: `text_config` when present, else `config`."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    inner = config.get("text_config")
    if inner is None:
        return config
    if not isinstance(inner, dict):
        raise ValueError(f"config text_config must be a dict, got {inner!r}")
    return inner


def _or(value: T | None, default: T) -> T:
    """`value`, or `default` where the config left it out (None; never a falsy 0)."""
    return default if value is None else value


def _resolve_auto(dtype: str, config: dict[str, Any], cfg: dict[str, Any]) -> str:
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a string, got {dtype!r}")
    if dtype != "auto":
        return dtype
    for source in (config, cfg):  # the wrapper's first: it names the dtype the model loads in
        for key in ("torch_dtype", "dtype"):
            value = source.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"config {key} must be a string, got {value!r}")
            return value if value in ("bfloat16", "float16", "float32") else "bfloat16"
    return "bfloat16"


def _check_len(name: str, seq: Any, layer_num: int) -> None:
    if not isinstance(seq, list) or len(seq) != layer_num:
        got = len(seq) if isinstance(seq, list) else type(seq).__name__
        raise ValueError(f"{name} must be a list of num_hidden_layers={layer_num} entries, got {got}")


# The largest value a config may give a size: far above any real model, far below what would
# exhaust memory (a num_hidden_layers of 10**12 would build a list of 10**12 layer ids).
MAX_LAYERS = 1 << 14
MAX_SIZE = 1 << 20  # heads, head dims, latent widths, hidden_size


def _opt_int(cfg: dict[str, Any], key: str, *, minimum: int = 1) -> int | None:
    """cfg[key], an int in [minimum, its maximum], or None where it is absent (or null)."""
    value = cfg.get(key)
    if value is None:
        return None
    if not is_int(value):
        raise ValueError(f"config {key} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"config {key} must be >= {minimum}, got {value!r}")
    maximum = MAX_LAYERS if key == "num_hidden_layers" else MAX_SIZE
    if value > maximum:
        raise ValueError(f"config {key} must be <= {maximum}, got {value!r}")
    return value


def _req_int(cfg: dict[str, Any], key: str, *, minimum: int = 1) -> int:
    value = _opt_int(cfg, key, minimum=minimum)
    if value is None:
        raise ValueError(f"config is missing {key}")
    return value


def model_groups(config: dict[str, Any]) -> list[str]:
    """The KV groups the model has: ["full"], or ["full", "swa"] (or ["swa"]) for hybrid
    models. Raises ValueError for a config that is not a dict or lacks num_hidden_layers."""
    cfg = _text_config(config)
    if cfg.get("kv_lora_rank") is not None:
        return ["full"]
    full, swa = _split_layers(cfg, _req_int(cfg, "num_hidden_layers"))
    return [name for name, ids in (("full", full), ("swa", swa)) if ids] or ["full"]


def load_model_config(model_name: str | None, path: str | None) -> dict[str, Any] | None:
    """The HF config.json of the model: `path` if given (ValueError if unreadable), else
    <model_name>/config.json when model_name is a local folder, else None."""
    if path is None and model_name:
        candidate = os.path.join(model_name, "config.json")
        path = candidate if os.path.isfile(candidate) else None
    if path is None:
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read model config {path!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"model config {path!r} is not a JSON object")
    return config
