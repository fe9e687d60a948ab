"""vLLM's offload keys as hicache page keys, and a transfer's blocks as (key, page) pairs.

vLLM names one offload chunk (blocks_per_chunk GPU blocks of one KV-cache group) by an
OffloadKey: the chunk's block hash + a 4-byte big-endian group index. hicache moves pages of
one GPU block each (a pool's page is a vLLM block, its page number the block id), so chunk
key k holds the pages sha256(k + i), i < blocks_per_chunk. The TP rank and the model are
not in the key: the sidecar keeps each registration's pages apart by its model id, TP rank
and namespace.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

KEY_HASH: Final = "sha256"


def group_of(offload_key: bytes) -> int:
    """The KV-cache group index an OffloadKey carries (its last 4 bytes)."""
    return int.from_bytes(offload_key[-4:], "big")


def page_key(offload_key: bytes, block: int) -> bytes:
    """The hicache key of block `block` (< blocks_per_chunk) of the chunk `offload_key`."""
    return hashlib.sha256(offload_key + block.to_bytes(4, "big")).digest()


def chunk_page_keys(offload_key: bytes, blocks_per_chunk: int) -> list[bytes]:
    return [page_key(offload_key, i) for i in range(blocks_per_chunk)]


@dataclass(frozen=True)
class GroupMoves:
    """One group's share of a transfer: the hicache keys and the GPU block ids they move."""

    group: int
    keys: list[bytes]
    blocks: list[int]


def plan_moves(
    offload_keys: Sequence[bytes],
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    blocks_per_chunk: int,
) -> list[GroupMoves]:
    """Pair each GPU block of a transfer with its hicache key.

    vLLM's GPULoadStoreSpec lists the blocks group by group (group_sizes[g] of them, the
    first being the request's logical block block_indices[g]); the chunk keys come in the
    same group order. The first chunk of a group may start mid-chunk: its leading
    block_indices[g] % blocks_per_chunk blocks are not part of the transfer.
    Raises ValueError when the keys do not cover the blocks.
    """
    if len(group_sizes) != len(block_indices) or sum(group_sizes) != len(block_ids):
        raise ValueError(
            f"GPU spec: group_sizes {list(group_sizes)} and block_indices {list(block_indices)} "
            f"do not describe {len(block_ids)} blocks"
        )
    by_group: dict[int, list[bytes]] = {}
    for key in offload_keys:
        by_group.setdefault(group_of(key), []).append(key)
    moves, start = [], 0
    for g, (size, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        chunks = by_group.pop(g, [])
        need = -(-(skip + size) // blocks_per_chunk)
        if len(chunks) != need:
            raise ValueError(f"group {g}: {size} blocks from block {first} span {need} chunks, got {len(chunks)} keys")
        keys = [page_key(chunks[(skip + i) // blocks_per_chunk], (skip + i) % blocks_per_chunk) for i in range(size)]
        moves.append(GroupMoves(g, keys, [int(b) for b in block_ids[start : start + size]]))
        start += size
    if by_group:
        raise ValueError(f"keys of groups {sorted(by_group)} have no blocks in the GPU spec")
    return moves
