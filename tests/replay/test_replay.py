"""`hicache replay`: the trace parser, the exact prefix LRU it compares with, and replays of
the Mooncake trace through real sidecar processes (a slice with real reuse, host tier far
smaller than the reuse, the default file tier behind it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.replay.lru import PrefixLRU, hit_rate, sweep
from hicache.replay.trace import Request, load_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "benchmarks" / "traces" / "mooncake_synthetic_trace.jsonl"


def test_the_lru_matches_the_traces_reference_figures() -> None:
    requests = load_trace(str(TRACE), page_size=16)
    assert len(requests) == 3993 and sum(r.input_tokens for r in requests) == 61_194_628
    got = [round(h, 3) for _, h in sweep(requests, [100_000, 1_000_000, 3_000_000, 10_000_000])]
    assert got == [0.012, 0.142, 0.315, 0.577]
    assert round(hit_rate(requests, None), 3) == 0.651
    assert round(hit_rate(requests, 3_000_000 // 512, nodes=4), 3) == 0.258


def test_a_prefix_lru_hits_the_longest_cached_prefix_and_drops_the_oldest() -> None:
    lru = PrefixLRU(3)
    a, b = Request(0, 1024, (1, 2), 512), Request(0, 1100, (1, 2, 3), 512)
    assert lru.request(a) == 0 and lru.request(b) == 2
    assert lru.request(Request(0, 512, (9,), 512)) == 0  # evicts block 1, the least recently used
    assert lru.request(b) == 0  # the prefix starts with the evicted block
    assert b.hit_tokens(3) == 1100 and b.hit_tokens(2) == 1024 and Request(0, 0, (), 512).hit_tokens(0) == 0
    with pytest.raises(ValueError, match="capacity must be >= 0 blocks or None, got -1"):
        PrefixLRU(-1)


def test_token_prompts_become_chained_pages_and_bad_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("[1, 2, 3, 4, 5]\n" + json.dumps({"input_ids": [1, 2, 3, 4, 9, 9], "timestamp": 5}) + "\n")
    a, b = load_trace(str(path), page_size=2)
    assert a.blocks[:2] == b.blocks[:2] and len(a.blocks) == 2 and len(b.blocks) == 3
    assert a.blocks[0] != a.blocks[1] and b.timestamp_ms == 5 and a.input_tokens == 5 and a.block_tokens == 2
    path.write_text('{"hash_ids": [1, 2], "input_length": 4000}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl line 1: .*input_length 4000 does not fit 2 blocks"):
        load_trace(str(path), page_size=16)
    path.write_text('[1, 2]\n{"hash_ids": "x"}\n')
    with pytest.raises(ValueError, match=r"line 2: not a trace request \(hash_ids must be a list of ints"):
        load_trace(str(path), page_size=16)


def replay(*flags: str, tmp_path: Path) -> dict:  # type: ignore[type-arg]
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "replay", *flags, "--report-json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "hit rate (tokens)" in proc.stdout and "LRU hit rate by size" in proc.stdout
    return json.loads(out.read_text())


def test_a_trace_slice_through_a_file_tier_sidecar_keeps_what_an_lru_of_its_size_would(tmp_path: Path) -> None:
    # 200 requests that reuse 0.45 of their tokens; a host tier of 1e5 tokens holds 0.025 of it
    r = replay(str(TRACE), "--first", "3600", "--requests", "200", "--host-size", "1e5", tmp_path=tmp_path)
    assert r["requests"] == 200 and r["storage_backend"] == "file" and r["host_pages_per_node"] == [195]
    assert r["lru_expectation"] == {"host_only": 0.025, "host_plus_storage": 0.4498}
    assert r["ratio"] >= 0.95, r
    assert r["corrupt_pages"] == 0 and r["pages_checked"] > 1000
    assert r["storage_writes"]["dropped"] == 0 and r["storage_writes"]["failed"] == 0
    assert r["storage_writes"]["done"] == r["offload_pages"]["stored"] == r["storage_pages"]
    assert r["hit_rate"]["storage"] > r["hit_rate"]["host"]


def test_two_nodes_without_a_storage_tier_match_two_host_lrus(tmp_path: Path) -> None:
    r = replay(
        str(TRACE), "--first", "3600", "--requests", "120", "--host-size", "3e5", "--nodes", "2",
        "--hicache-storage-backend", "none", tmp_path=tmp_path,
    )  # fmt: skip
    assert r["nodes"] == 2 and r["hit_rate"]["storage"] == 0
    assert r["lru_expectation"]["host_plus_storage"] == r["lru_expectation"]["host_only"] > 0
    assert r["ratio"] >= 0.98 and r["corrupt_pages"] == 0


def test_replay_refuses_bad_flags_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "replay", str(TRACE), "--nodes", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--nodes must be >= 1, got 0" in proc.stderr
