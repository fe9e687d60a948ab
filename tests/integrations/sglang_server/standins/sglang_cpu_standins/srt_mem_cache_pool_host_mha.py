"""For sglang/srt/mem_cache/pool_host/mha.py, which imports the `--hicache-io-backend direct`
ops from sgl_kernel.kvcacheio only on CUDA and HIP. They are index copies between token rows.

Shapes: a layer_first layer is [tokens, heads, head_dim]; a page_first_direct buffer is
[pages, layers, page_size, heads, head_dim]. Index tensors hold token slots (whole pages).
"""

from __future__ import annotations

from types import ModuleType

import torch


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    pages, offsets = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_indices] = src[pages, layer_id, offsets].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    pages, offsets = dst_indices // page_size, dst_indices % page_size
    layers = len(src_ptrs) // len(dst_ptrs)  # K layers, then V layers
    for i, src in enumerate(src_ptrs):
        dst_ptrs[i // layers][pages, i % layers, offsets] = src[src_indices].to(dst_ptrs[0].device)


def after(module: ModuleType) -> None:
    for op in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf):
        if not hasattr(module, op.__name__):
            setattr(module, op.__name__, op)
