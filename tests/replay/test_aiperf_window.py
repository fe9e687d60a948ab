"""benchmarks/aiperf_trace.py: the window of Mooncake's trace that AIPerf replays (blocks
rescaled, requests cut to their prefix), and the reuse an engine's prefix cache would find in it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import aiperf_trace as T  # noqa: E402


def row(ids: list[int], length: int) -> dict[str, object]:
    return {"timestamp": 0, "input_length": length, "output_length": 1, "hash_ids": ids}


def test_a_length_is_rescaled_block_by_block_with_its_partial_last_block() -> None:
    assert T.scaled_length(512, 1, 32) == 32
    assert T.scaled_length(3 * 512, 3, 32) == 96
    assert T.scaled_length(2 * 512 + 256, 3, 32) == 64 + 16
    assert T.scaled_length(2 * 512 + 1, 3, 32) == 64 + 1  # the last block keeps at least a token


@pytest.mark.parametrize(("length", "blocks"), [(0, 1), (513, 1), (1024, 3), (100, 0)])
def test_a_length_that_does_not_fit_its_blocks_is_refused_by_value(length: int, blocks: int) -> None:
    with pytest.raises(ValueError, match=f"input_length {length} does not fit {blocks} blocks"):
        T.scaled_length(length, blocks, 32)


def test_the_window_starts_at_zero_and_cuts_requests_to_their_prefix() -> None:
    rows = T.window(3000, 20, block=32, max_blocks=8, max_output=4)
    assert len(rows) == 20 and rows[0]["timestamp"] == 0
    assert all(r["input_length"] <= 8 * 32 and len(r["hash_ids"]) <= 8 for r in rows)
    assert all(1 <= r["output_length"] <= 4 for r in rows)
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps) and stamps[-1] > 0
    raw = [json.loads(line) for line in T.TRACE.read_text().splitlines()[3000:3020]]
    cut = [(r, w) for r, w in zip(raw, rows, strict=True) if len(r["hash_ids"]) > 8]
    assert cut and all(w["input_length"] == 256 and w["hash_ids"] == r["hash_ids"][:8] for r, w in cut)
    kept = [(r, w) for r, w in zip(raw, rows, strict=True) if len(r["hash_ids"]) <= 8]
    assert kept and all(
        w["input_length"] == T.scaled_length(r["input_length"], len(r["hash_ids"]), 32) for r, w in kept
    )


@pytest.mark.parametrize(
    ("first", "count", "needle"), [(-1, 5, "first -1"), (0, 0, "count 0"), (3990, 10, "3990 \\+ 10 is past its end")]
)
def test_a_bad_window_is_refused_by_value(first: int, count: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        T.window(first, count, block=32, max_blocks=8, max_output=4)


def test_the_lru_hits_leading_full_blocks_and_never_the_last_token() -> None:
    rows = [row([1, 2, 3], 96), row([1, 2, 4], 96), row([1, 2, 3], 96), row([1, 2, 3, 5], 100)]
    # 2nd: blocks 1, 2; 3rd: all three cached, but the last token is computed: 2 blocks;
    # 4th: 1, 2, 3 cached (3 blocks of its 3 full ones: 96 of 100 tokens)
    assert T.lru_hit_tokens(rows, 32, None) == 64 + 64 + 96
    assert T.lru_hit_tokens(rows, 32, 0) == 0
    again = [row([1, 2, 3], 96), row([4, 5, 6], 96), row([1, 2, 3], 96)]
    assert T.lru_hit_tokens(again, 32, None) == 64
    assert T.lru_hit_tokens(again, 32, 3) == 0  # [4, 5, 6] dropped [1, 2, 3]


def test_the_reuse_of_the_issues_window_is_what_the_traces_readme_says() -> None:
    rows = T.window(3000, 500, block=32, max_blocks=1000, max_output=8)
    r = T.reuse(rows, 32, 63)
    assert r["prompt_tokens"] == sum(x["input_length"] for x in rows)
    assert 0.44 < r["unbounded_hit_tokens"] / r["prompt_tokens"] < 0.46  # requests 3000-3500 reuse 0.448
    assert 0 < r["engine_lru_hit_tokens"] < 0.05 * r["prompt_tokens"]
    assert r["ceiling_tokens"] == r["unbounded_hit_tokens"] - r["engine_lru_hit_tokens"]
