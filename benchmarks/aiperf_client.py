"""NVIDIA's AIPerf as the benchmark client: one `aiperf profile` replay of a trace window against
one or more OpenAI servers, its exports read back, and the servers' Prometheus samples.

AIPerf lives in an environment of its own (`make aiperf-env`: .venv-aiperf, requirements-aiperf.txt);
it is a benchmark dependency, not one of hicache's. benchmarks/aiperf_tokenizer.py (run by that
environment's python) gives the model folder a tokenizer and AIPerf a cache entry for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
AIPERF = Path(os.environ.get("HICACHE_AIPERF") or ROOT / ".venv-aiperf" / "bin" / "aiperf")
NEEDED = "AIPerf is not installed: run `make aiperf-env` (it builds .venv-aiperf)"


@dataclass(frozen=True)
class Client:
    """AIPerf at `aiperf`, its tokenizer cache in `hf_home`, the tokenizer's name `tokenizer`."""

    aiperf: Path
    hf_home: Path
    tokenizer: str

    @classmethod
    def prepare(cls, model: Path, vocab: int, hf_home: Path, aiperf: Path = AIPERF) -> Client:
        """Writes the model's tokenizer (benchmarks/aiperf_tokenizer.py in AIPerf's environment).
        Raises FileNotFoundError when AIPerf is missing, RuntimeError when the script fails."""
        python = aiperf.parent / "python"
        if not aiperf.exists() or not python.exists():
            raise FileNotFoundError(f"{NEEDED}: no {aiperf}")
        script = str(Path(__file__).with_name("aiperf_tokenizer.py"))
        out = subprocess.run(
            [str(python), "-P", script, str(model), str(hf_home), str(vocab)],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode:
            raise RuntimeError(f"the tokenizer was not made: {out.stderr[-2000:]}")
        return cls(aiperf, hf_home, out.stdout.strip().splitlines()[-1])

    def profile(self, urls: list[str], model: str, trace: Path, block: int, out: Path, timeout_s: float = 3600) -> Run:
        """Replays `trace` (mooncake_trace rows) at its timestamps against `urls` (round robin),
        streaming completions, a new connection for each request (a pooled one can meet the
        server closing it); every request generates exactly its output_length tokens.
        Raises RuntimeError, with AIPerf's output, when it fails."""
        args = [str(self.aiperf), "profile", "--model-names", model, "--tokenizer", self.tokenizer]
        for url in urls:
            args += ["--url", url]
        args += [
            "--endpoint-type", "completions", "--streaming", "--custom-dataset-type", "mooncake_trace",
            "--input-file", str(trace), "--isl-block-size", str(block), "--fixed-schedule",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--random-seed", "1",
            "--connection-reuse-strategy", "never",
            "--request-timeout-seconds", "1800", "--output-artifact-dir", str(out), "--ui-type", "none",
            "--no-gpu-telemetry", "--no-server-metrics",
        ]  # fmt: skip
        env = {**os.environ, "HF_HOME": str(self.hf_home), "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        (out / "aiperf.stdout").write_text(done.stdout + done.stderr)
        summary = out / "profile_export_aiperf.json"
        if done.returncode or not summary.exists():
            raise RuntimeError(f"aiperf exited with {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
        records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines() if line]
        return Run(json.loads(summary.read_text()), records)


@dataclass(frozen=True)
class Run:
    """One replay: AIPerf's summary export and its per-request records."""

    summary: dict[str, Any]
    records: list[dict[str, Any]]

    def metric(self, name: str, stat: str = "avg") -> float:
        return float(self.summary[name][stat])

    @property
    def errors(self) -> int:
        return sum(int(e.get("count", 1)) for e in self.summary.get("error_summary") or [])

    def prompt_lengths(self) -> dict[int, int]:
        """Each answered request's prompt tokens as the server counted them, by its index in the
        trace (a failed request has none: `errors` counts it)."""
        out = {}
        for record in self.records:
            if "input_sequence_length" not in record["metrics"]:
                continue
            session = record["metadata"]["conversation_id"]
            out[int(session.rpartition("_")[2])] = int(record["metrics"]["input_sequence_length"]["value"])
        return out

    def report(self) -> dict[str, float]:
        """TTFT p50/p90/p99 and end-to-end latency p50 (seconds), output tokens/s, errors."""
        return {
            "ttft_p50_s": self.metric("time_to_first_token", "p50") / 1e3,
            "ttft_p90_s": self.metric("time_to_first_token", "p90") / 1e3,
            "ttft_p99_s": self.metric("time_to_first_token", "p99") / 1e3,
            "latency_p50_s": self.metric("request_latency", "p50") / 1e3,
            "output_tokens_per_s": self.metric("output_token_throughput"),
            "requests": self.metric("request_count"),
            "errors": self.errors,
            "duration_s": self.metric("benchmark_duration"),
        }


Samples = list[tuple[str, dict[str, str], float]]  # name, labels, value


def scrape(url: str) -> Samples:
    """A Prometheus endpoint's samples (prometheus_client's parser, as the tests use)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for n, got, v in samples if n == name and all(got.get(k) == w for k, w in labels.items()))
