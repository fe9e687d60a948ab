"""For sglang/kernels/ops/kvcache/cache_move.py, which on CPU imports
`copy_all_layer_kv_cache_cpu` from sgl_kernel; PyPI has no CPU sgl_kernel. It is a row copy:
in every buffer (data_ptrs[i], rows strides[i] bytes apart), row tgt_loc[j] takes row
src_loc[j] (all rows read before any is written)."""

from __future__ import annotations

import ctypes
from types import ModuleType

import torch


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src_loc.tolist()]
        for t, row in zip(tgt_loc.tolist(), rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def before() -> dict[str, ModuleType]:
    kernel = ModuleType("sgl_kernel")
    kernel.copy_all_layer_kv_cache_cpu = copy_all_layer_kv_cache_cpu  # type: ignore[attr-defined]
    return {"sgl_kernel": kernel}
