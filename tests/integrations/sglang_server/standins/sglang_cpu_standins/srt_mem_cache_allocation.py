"""For sglang/srt/mem_cache/allocation.py, which on CPU imports `assign_req_to_token_pool_cpu`
from sgl_kernel; PyPI has no CPU sgl_kernel. It is an index copy: for each request i,
req_to_token[req_pool_indices[i], start[i]:end[i]] takes the next end[i] - start[i] slots of
out_cache_loc."""

from __future__ import annotations

from types import ModuleType

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    at = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[req, start:end] = out_cache_loc[at : at + end - start]
        at += end - start


def before() -> dict[str, ModuleType]:
    kernel = ModuleType("sgl_kernel")
    kernel.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu  # type: ignore[attr-defined]
    return {"sgl_kernel": kernel}
