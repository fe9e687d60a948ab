"""A window of Mooncake's trace (benchmarks/traces/mooncake_synthetic_trace.jsonl) as AIPerf
replays it against a small model, and the reuse that window holds.

The trace gives one hash id per 512-token block. AIPerf (--custom-dataset-type mooncake_trace
--isl-block-size B) turns each id into the same B tokens every time it appears, but it takes
`input_length` literally, so a window for blocks of B tokens rescales it:
(blocks - 1) * B + round(last block's tokens * B / 512), at least one token in the last block.
`max_blocks` keeps a request's first blocks only (its prefix: the sharing between requests is
unchanged up to there), which bounds the prefill a 2-core machine must do; `max_output` caps the
tokens generated. Timestamps start at 0 at the window's first request.

The reuse: an exact prefix LRU over whole blocks, as an engine's prefix cache sees them. A
request hits its longest run of leading full blocks in the cache, but never its last token (an
engine computes at least one), then every full block of it is inserted or touched and the
least recently used beyond the capacity are dropped (`hicache replay`'s PrefixLRU).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hicache.replay.lru import PrefixLRU
from hicache.replay.trace import MOONCAKE_BLOCK_TOKENS as TRACE_BLOCK
from hicache.replay.trace import Request

TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl"


def scaled_length(input_length: int, blocks: int, block: int) -> int:
    """`input_length` tokens over `blocks` trace blocks, rescaled to blocks of `block` tokens."""
    last = input_length - (blocks - 1) * TRACE_BLOCK
    if blocks < 1 or not 0 < last <= TRACE_BLOCK:
        raise ValueError(f"input_length {input_length} does not fit {blocks} blocks of {TRACE_BLOCK} tokens")
    return (blocks - 1) * block + max(1, round(last * block / TRACE_BLOCK))


def window(
    first: int,
    count: int,
    *,
    block: int,
    max_blocks: int,
    max_output: int,
    trace: Path = TRACE,
) -> list[dict[str, Any]]:
    """Requests first .. first + count - 1 of the trace as AIPerf mooncake_trace rows."""
    if first < 0 or count < 1 or block < 1 or max_blocks < 1 or max_output < 1:
        raise ValueError(
            f"window needs first >= 0 and count, block, max_blocks, max_output >= 1: got first {first}, "
            f"count {count}, block {block}, max_blocks {max_blocks}, max_output {max_output}"
        )
    with trace.open() as f:
        lines = [line for line in f if line.strip()]
    if first + count > len(lines):
        raise ValueError(f"the trace has {len(lines)} requests: {first} + {count} is past its end")
    rows = [json.loads(line) for line in lines[first : first + count]]
    start = rows[0]["timestamp"]
    out = []
    for row in rows:
        ids = row["hash_ids"]
        length = scaled_length(row["input_length"], len(ids), block)
        if len(ids) > max_blocks:
            ids, length = ids[:max_blocks], max_blocks * block
        out.append(
            {
                "timestamp": row["timestamp"] - start,
                "input_length": length,
                "output_length": max(1, min(row["output_length"], max_output)),
                "hash_ids": ids,
            }
        )
    return out


def write(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def lru_hit_tokens(rows: Iterable[dict[str, Any]], block: int, capacity_blocks: int | None) -> int:
    """Prompt tokens an exact prefix LRU of `capacity_blocks` blocks (None: unbounded) serves
    from cache over `rows`, in order (hicache replay's PrefixLRU over each request's full
    blocks; see the module's docstring)."""
    cache = PrefixLRU(capacity_blocks)
    hit = 0
    for row in rows:
        full = tuple(row["hash_ids"][: row["input_length"] // block])
        found = cache.request(Request(row["timestamp"], row["input_length"], full, block))
        hit += min(found, (row["input_length"] - 1) // block) * block
    return hit


def reuse(rows: list[dict[str, Any]], block: int, engine_blocks: int) -> dict[str, int]:
    """The window's prompt tokens, what an unbounded LRU serves, what an LRU of the engine's
    own size serves, and the ceiling for an external cache: the difference."""
    unbounded = lru_hit_tokens(rows, block, None)
    engine = lru_hit_tokens(rows, block, engine_blocks)
    return {
        "prompt_tokens": sum(row["input_length"] for row in rows),
        "unbounded_hit_tokens": unbounded,
        "engine_lru_hit_tokens": engine,
        "ceiling_tokens": unbounded - engine,
    }
