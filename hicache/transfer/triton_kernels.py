"""Triton page gather/scatter between two flat pools of any layouts.

One program copies one (page, layer) chunk of one buffer, a 2-D tile of rows at a time: a
chunk that is contiguous on both sides is cut into rows of WHOLE_ROW_BYTES (so its tiles
are as large as a strided chunk's), a strided one has a row per token. All layers go in one
launch through tables of per-layer chunk offsets, uploaded with the page lists in one copy
per call (a layer-wise transfer makes one call per layer); K, V and scale buffers get one launch each, so each has its own row width.
Cutting chunks into parts for several programs was measured on an H200 and did not help
(README, "GPU figures"). Where every address, stride and width is 16-byte aligned (all
real geometries), rows move as 16-byte vectors (ld.global.v4.b32; tests/test_triton_ptx.py
compiles the kernel for sm_90 and checks); otherwise as the widest word (8/4/2/1 bytes)
that fits. Tiles are 2-D, up to TILE_WORDS words (several rows at once, so many wide loads
are in flight per program). Runs on CUDA, and on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from hicache.pools.flat import FlatPool
from hicache.transfer.plan import TransferPlan

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
MAX_BLOCK = 1024  # words per row segment
TILE_WORDS = 4096  # words per 2-D tile (rows x row segment)
VECTOR_BYTES = 16  # one ld.global.v4.b32 / st.global.v4.b32 per thread and step
WHOLE_ROW_BYTES = 4096  # the row width a contiguous chunk is cut into (when it divides the chunk)


@triton.jit
def _copy_chunks_kernel(
    src_flat,  # the source pool as words
    dst_flat,
    src_layer_offsets,  # int64 [layers]: (page 0, layer l) of this buffer, in units of VEC words
    dst_layer_offsets,
    src_pages,  # int64 [pairs]
    dst_pages,
    src_page_stride,  # in units of VEC words
    dst_page_stride,
    src_row_stride,
    dst_row_stride,
    ROWS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    # Every offset is (something) * VEC, so the compiler can prove VEC-word alignment and
    # move VEC words (16 bytes) per load and store; a hint on a loaded value would be lost.
    pair = tl.program_id(0)
    layer = tl.program_id(1)
    src_page = tl.load(src_pages + pair)
    dst_page = tl.load(dst_pages + pair)
    src = src_flat + (tl.load(src_layer_offsets + layer) + src_page * src_page_stride) * VEC
    dst = dst_flat + (tl.load(dst_layer_offsets + layer) + dst_page * dst_page_stride) * VEC
    for row0 in range(0, ROWS, ROW_BLOCK):
        rows = row0 + tl.arange(0, ROW_BLOCK)
        for start in range(0, ROW_WORDS, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = (rows[:, None] < ROWS) & (cols[None, :] < ROW_WORDS)
            values = tl.load(src + rows[:, None] * (src_row_stride * VEC) + cols[None, :], mask=mask)
            tl.store(dst + rows[:, None] * (dst_row_stride * VEC) + cols[None, :], values, mask=mask)


def word_and_vec(*quantities: int) -> tuple[int, int]:
    """(word bytes, words per vector): 4-byte words moved 4 at a time when every address,
    stride and width is 16-byte aligned, else the widest word that divides them all, one at a time."""
    if all(q % VECTOR_BYTES == 0 for q in quantities):
        return 4, VECTOR_BYTES // 4
    for word in (8, 4, 2, 1):
        if all(q % word == 0 for q in quantities):
            return word, 1
    return 1, 1


def _as_words(flat: torch.Tensor, word: int) -> torch.Tensor:
    return flat[: flat.numel() - flat.numel() % word].view(_WORDS[word])


def copy_pages_triton(src: FlatPool, dst: FlatPool, plan: TransferPlan) -> None:
    """Launch one kernel per buffer that copies plan.src_pages -> plan.dst_pages for plan.layers.

    The single launcher of _copy_chunks_kernel: it checks devices, dtypes and contiguity.
    On CUDA a host pool must be pinned (HostKVPool registers its memory): Triton maps each
    pointer argument to a device pointer and refuses pageable memory with ValueError.
    """
    assert src.geometry == dst.geometry, "pools of different geometries"
    assert src.flat.dtype == torch.uint8 and dst.flat.dtype == torch.uint8
    assert src.flat.is_contiguous() and dst.flat.is_contiguous()
    if plan.num_pages == 0 or not plan.layers:
        return
    device = src.flat.device if src.flat.is_cuda else dst.flat.device
    g = src.geometry
    launches = []
    tables = [plan.src_pages.astype(np.int64, copy=False), plan.dst_pages.astype(np.int64, copy=False)]
    for b in range(len(g.buffers)):
        ss, ds = src.layout.strides[b], dst.layout.strides[b]
        src_offs = [ss.offset(0, layer) for layer in plan.layers]
        dst_offs = [ds.offset(0, layer) for layer in plan.layers]
        rows, row_bytes = g.page_size, ss.row_bytes
        src_row, dst_row = ss.token_stride, ds.token_stride
        if ss.chunk_contiguous and ds.chunk_contiguous:  # one block: cut into rows of its own
            chunk = g.chunk_bytes(g.buffers[b])
            row_bytes = WHOLE_ROW_BYTES if chunk % WHOLE_ROW_BYTES == 0 else chunk
            rows, src_row, dst_row = chunk // row_bytes, row_bytes, row_bytes
        word, vec = word_and_vec(
            row_bytes, ss.page_stride, ds.page_stride, src_row, dst_row, src.flat.data_ptr(), dst.flat.data_ptr(),
            *src_offs, *dst_offs,
        )  # fmt: skip
        unit = word * vec
        row_words = row_bytes // word
        block = min(MAX_BLOCK, triton.next_power_of_2(row_words))
        row_block = max(1, min(triton.next_power_of_2(rows), TILE_WORDS // block))
        tables += [np.asarray(src_offs, dtype=np.int64) // unit, np.asarray(dst_offs, dtype=np.int64) // unit]
        strides = (ss.page_stride // unit, ds.page_stride // unit, src_row // unit, dst_row // unit)
        shape = dict(ROWS=rows, ROW_WORDS=row_words, ROW_BLOCK=row_block, BLOCK=block, VEC=vec)
        launches.append((word, strides, shape))
    # one upload of every table: a copy from pageable memory may wait for the stream's earlier work
    table = torch.from_numpy(np.concatenate(tables)).to(device, non_blocking=True)
    src_pages, dst_pages, *offsets = torch.split(table, [len(t) for t in tables])
    for b, (word, strides, shape) in enumerate(launches):
        _copy_chunks_kernel[(plan.num_pages, len(plan.layers))](
            _as_words(src.flat, word),
            _as_words(dst.flat, word),
            offsets[2 * b],
            offsets[2 * b + 1],
            src_pages,
            dst_pages,
            *strides,
            **shape,
        )
