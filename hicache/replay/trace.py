"""KV-cache traces to replay: Mooncake's format, or plain token-id prompts.

Mooncake (FAST'25 release): one JSON object per line, `{"timestamp": ms, "input_length":
tokens, "output_length": tokens, "hash_ids": [block ids]}`, a block being 512 tokens and
the ids chained (two requests share a block id at position i only if they share the whole
prefix up to it). Token prompts: one JSON list of token ids per line, or an object with
"input_ids" (and an optional "timestamp"); their blocks are pages of the replay's page size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Request:
    """One request: its arrival (ms from the start), its input tokens and its blocks, each
    block a tuple that identifies it with everything before it (a chained id)."""

    timestamp_ms: float
    input_tokens: int
    blocks: tuple[int, ...]  # Mooncake: the hash ids; token prompts: one id per full page
    block_tokens: int

    def hit_tokens(self, hit_blocks: int) -> int:
        """Tokens served by a hit of the first `hit_blocks` blocks: every input token for a
        whole-prefix hit (the last block may be partial), else whole blocks."""
        if hit_blocks >= len(self.blocks):
            return self.input_tokens if self.blocks else 0
        return hit_blocks * self.block_tokens


def load_trace(path: str, *, page_size: int, first: int = 0, count: int | None = None) -> list[Request]:
    """Requests first .. first+count of the trace at `path` (either format, by its first
    line). Raises OSError for a missing file, ValueError naming the line of a bad one."""
    out: list[Request] = []
    chains: dict[tuple[int, ...], int] = {}  # token prompts: page token tuples -> chained id
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if n <= first:
                continue
            if count is not None and len(out) >= count:
                break
            try:
                out.append(_parse(json.loads(line), page_size, chains))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path} line {n}: not a trace request ({exc})") from None
    return out


def _parse(obj: object, page_size: int, chains: dict[tuple[int, ...], int]) -> Request:
    if isinstance(obj, dict) and "hash_ids" in obj:
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"hash_ids must be a list of ints, got {ids!r:.80}")
        length = int(obj["input_length"])
        if length < 0 or length > len(ids) * MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"input_length {length} does not fit {len(ids)} blocks of {MOONCAKE_BLOCK_TOKENS}")
        return Request(float(obj.get("timestamp", 0)), length, tuple(ids), MOONCAKE_BLOCK_TOKENS)
    tokens = obj.get("input_ids") if isinstance(obj, dict) else obj
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ValueError("expected hash_ids, a list of token ids, or input_ids")
    blocks = []
    prefix: tuple[int, ...] = ()
    for at in range(0, len(tokens) - page_size + 1, page_size):
        prefix = (*prefix, *tokens[at : at + page_size])
        blocks.append(chains.setdefault(prefix, len(chains)))
    ts = float(obj.get("timestamp", 0)) if isinstance(obj, dict) else 0.0
    return Request(ts, len(tokens), tuple(blocks), page_size)
