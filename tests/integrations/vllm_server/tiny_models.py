"""Tiny models with seeded random weights, written at test time for vLLM's real server (no
hub, no tokenizer): config.json + model.safetensors in a folder.

Greedy outputs of such a model must depend on its KV cache (a wrong page changes them) and
yet be stable (a different prefill chunking must not): a few layers, hidden <= 384, and an
lm_head scaled up so the argmax is peaked.

- llama(): LlamaForCausalLM, grouped-query attention (2 KV heads of 64).
- deepseek_v2(): DeepseekV2ForCausalLM with MLA (kv_lora_rank 512 + qk_rope_head_dim 64),
  dense MLPs, no q LoRA; vLLM's CPU build serves it through CPU_MLA with block size 16.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

VOCAB = 512
LM_HEAD_STD = 1.0  # the other linear layers use 0.02 (HF's initializer_range)
# what every model's config.json says alike
_CONFIG = {
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def _save(folder: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> str:
    """config.json, and the bfloat16 weights as model.safetensors: an 8-byte little-endian
    header length, the JSON header (name -> dtype, shape, byte range), then the bytes.
    Written here so that any environment with torch can make the model."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16
        blob = tensor.contiguous().view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for blob in blobs:
            f.write(blob)
    return str(folder)


def _randn(gen: torch.Generator, *shape: int, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bfloat16)


def _common(gen: torch.Generator, hidden: int, vocab: int) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": _randn(gen, vocab, hidden, std=1.0),
        "model.norm.weight": _ones(hidden),
        "lm_head.weight": _randn(gen, vocab, hidden, std=LM_HEAD_STD),
    }


def _mlp(gen: torch.Generator, prefix: str, hidden: int, inter: int) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{prefix}.mlp.gate_proj.weight", _randn(gen, inter, hidden)
    yield f"{prefix}.mlp.up_proj.weight", _randn(gen, inter, hidden)
    yield f"{prefix}.mlp.down_proj.weight", _randn(gen, hidden, inter)
    yield f"{prefix}.input_layernorm.weight", _ones(hidden)
    yield f"{prefix}.post_attention_layernorm.weight", _ones(hidden)


def llama(folder: Path, *, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> str:
    """A LlamaForCausalLM in `folder`; returns the folder. Shape per layer of KV: kv_heads x
    head_dim (hidden / heads) x bfloat16."""
    head_dim, inter = hidden // heads, 2 * hidden
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        **_CONFIG,
    }
    gen = torch.Generator().manual_seed(seed)
    weights = _common(gen, hidden, VOCAB)
    for i in range(layers):
        p = f"model.layers.{i}"
        weights[f"{p}.self_attn.q_proj.weight"] = _randn(gen, heads * head_dim, hidden)
        weights[f"{p}.self_attn.k_proj.weight"] = _randn(gen, kv_heads * head_dim, hidden)
        weights[f"{p}.self_attn.v_proj.weight"] = _randn(gen, kv_heads * head_dim, hidden)
        weights[f"{p}.self_attn.o_proj.weight"] = _randn(gen, hidden, heads * head_dim)
        weights.update(_mlp(gen, p, hidden, inter))
    return _save(folder, config, weights)


def deepseek_v2(
    folder: Path,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_lora_rank: int = 512,
    rope: int = 64,
    seed: int = 0,
) -> str:
    """A DeepseekV2ForCausalLM (MLA) in `folder`; returns the folder. vLLM caches one latent
    row of kv_lora_rank + rope values per token and layer."""
    nope, v_dim, inter = 64, 64, 2 * hidden
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "moe_intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": None,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_dim,
        "n_routed_experts": 1,  # transformers wants ints; first_k_dense_replace keeps every layer dense
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "first_k_dense_replace": layers,
        "moe_layer_freq": 1,
        "rms_norm_eps": 1e-6,
        **_CONFIG,
    }
    gen = torch.Generator().manual_seed(seed)
    weights = _common(gen, hidden, VOCAB)
    for i in range(layers):
        p = f"model.layers.{i}.self_attn"
        weights[f"{p}.q_proj.weight"] = _randn(gen, heads * (nope + rope), hidden)
        weights[f"{p}.kv_a_proj_with_mqa.weight"] = _randn(gen, kv_lora_rank + rope, hidden)
        weights[f"{p}.kv_a_layernorm.weight"] = _ones(kv_lora_rank)
        weights[f"{p}.kv_b_proj.weight"] = _randn(gen, heads * (nope + v_dim), kv_lora_rank)
        weights[f"{p}.o_proj.weight"] = _randn(gen, hidden, heads * v_dim)
        weights.update(_mlp(gen, f"model.layers.{i}", hidden, inter))
    return _save(folder, config, weights)
