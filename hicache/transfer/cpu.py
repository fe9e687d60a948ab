"""The torch copy path: one strided copy per (page run, layer run, buffer)."""

from __future__ import annotations

import torch

from hicache.pools.flat import FlatPool
from hicache.transfer.plan import TransferPlan


def copy_views(src: FlatPool, dst: FlatPool, plan: TransferPlan) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (destination, source) view pairs that carry out `plan`, layer run by layer run."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for first, count in plan.layer_runs:
        for s_page, d_page, n in plan.runs:
            for b in range(len(src.geometry.buffers)):
                dsts.append(dst.chunks(b, d_page, first, n, count))
                srcs.append(src.chunks(b, s_page, first, n, count))
    return dsts, srcs


def copy_pages(src: FlatPool, dst: FlatPool, plan: TransferPlan) -> None:
    """Copy plan.src_pages of `src` into plan.dst_pages of `dst`, for plan.layers."""
    dsts, srcs = copy_views(src, dst, plan)
    if dsts:
        torch._foreach_copy_(dsts, srcs)
