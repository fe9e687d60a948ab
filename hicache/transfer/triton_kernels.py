"""Triton page gather/scatter between two flat pools of any layouts.

One program copies one (page, layer) chunk of one buffer. All layers go in one launch
through tables of per-layer base pointers; K, V and scale buffers get one launch each, so
each has its own row width. Rows are moved as the widest word (8/4/2/1 bytes) that every
pointer, stride and width allows, in 2-D tiles of up to TILE_WORDS words (several rows at
once, so many wide loads are in flight per program), with contiguity hints on the
column offsets so the compiler can vectorise them. Runs on CUDA, and on CPU under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.pools.flat import FlatPool
from hicache.transfer.plan import TransferPlan

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
MAX_BLOCK = 1024  # words per row segment
TILE_WORDS = 4096  # words per 2-D tile (rows x row segment)


@triton.jit
def _copy_chunks_kernel(
    src_layer_ptrs,  # int64 [layers]: byte address of (page 0, layer l) of this buffer
    dst_layer_ptrs,
    src_pages,  # int64 [pairs]
    dst_pages,
    src_page_stride,  # in words
    dst_page_stride,
    src_row_stride,
    dst_row_stride,
    ROWS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    WORD: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1)
    src_page = tl.load(src_pages + pair)
    dst_page = tl.load(dst_pages + pair)
    src = tl.load(src_layer_ptrs + layer).to(tl.pointer_type(WORD)) + src_page * src_page_stride
    dst = tl.load(dst_layer_ptrs + layer).to(tl.pointer_type(WORD)) + dst_page * dst_page_stride
    for row0 in range(0, ROWS, ROW_BLOCK):
        rows = row0 + tl.arange(0, ROW_BLOCK)
        for start in range(0, ROW_WORDS, BLOCK):
            cols = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
            mask = (rows[:, None] < ROWS) & (cols[None, :] < ROW_WORDS)
            values = tl.load(src + rows[:, None] * src_row_stride + cols[None, :], mask=mask)
            tl.store(dst + rows[:, None] * dst_row_stride + cols[None, :], values, mask=mask)


_TL_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


def _word_bytes(*quantities: int) -> int:
    for word in (8, 4, 2, 1):
        if all(q % word == 0 for q in quantities):
            return word
    return 1


def copy_pages_triton(src: FlatPool, dst: FlatPool, plan: TransferPlan) -> None:
    """Launch one kernel per buffer that copies plan.src_pages -> plan.dst_pages for plan.layers.

    The single launcher of _copy_chunks_kernel: it checks devices, dtypes and contiguity.
    """
    assert src.geometry == dst.geometry, "pools of different geometries"
    assert src.flat.dtype == torch.uint8 and dst.flat.dtype == torch.uint8
    assert src.flat.is_contiguous() and dst.flat.is_contiguous()
    if plan.num_pages == 0 or not plan.layers:
        return
    device = src.flat.device if src.flat.is_cuda else dst.flat.device
    src_pages = torch.as_tensor(plan.src_pages, dtype=torch.int64).to(device, non_blocking=True)
    dst_pages = torch.as_tensor(plan.dst_pages, dtype=torch.int64).to(device, non_blocking=True)
    g = src.geometry
    for b in range(len(g.buffers)):
        ss, ds = src.layout.strides[b], dst.layout.strides[b]
        src_ptrs = [src.flat.data_ptr() + ss.offset(0, layer) for layer in plan.layers]
        dst_ptrs = [dst.flat.data_ptr() + ds.offset(0, layer) for layer in plan.layers]
        whole = ss.chunk_contiguous and ds.chunk_contiguous
        rows, row_bytes = (1, g.chunk_bytes(g.buffers[b])) if whole else (g.page_size, ss.row_bytes)
        word = _word_bytes(
            row_bytes, ss.page_stride, ds.page_stride, ss.token_stride, ds.token_stride, *src_ptrs, *dst_ptrs
        )
        row_words = row_bytes // word
        block = min(MAX_BLOCK, triton.next_power_of_2(row_words))
        row_block = max(1, min(triton.next_power_of_2(rows), TILE_WORDS // block))
        _copy_chunks_kernel[(plan.num_pages, len(plan.layers))](
            torch.tensor(src_ptrs, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(dst_ptrs, dtype=torch.int64).to(device, non_blocking=True),
            src_pages,
            dst_pages,
            ss.page_stride // word,
            ds.page_stride // word,
            ss.token_stride // word,
            ds.token_stride // word,
            ROWS=rows,
            ROW_WORDS=row_words,
            ROW_BLOCK=row_block,
            BLOCK=block,
            WORD=_TL_WORDS[word],
        )
