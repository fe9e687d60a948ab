"""vLLM's real OpenAI server as a subprocess, and a client for token-id prompts.

The server runs from .venv-vllm-cpu (`make vllm-cpu-env`: vllm-cpu 0.32.0, whose engine runs
on this CPU machine), or from $HICACHE_VLLM_SERVER_PYTHON. `vllm serve` does not start from
vllm-cpu (it reads the version of a distribution named "vllm"); `python -m
vllm.entrypoints.openai.api_server` does. Without a tokenizer, prompts are token-id lists
and `"return_token_ids": true` gives the output ids.

vLLM's prefix-cache counters on /metrics (summed over labels by metrics()):
- vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total: prompt tokens looked up in,
  and found in, the engine's own KV cache;
- vllm:external_prefix_cache_queries_total, vllm:external_prefix_cache_hits_total: the same
  for the KV connector (hicache under HiCacheConnector);
- vllm:prompt_tokens_by_source_total{source=...} and
  vllm:prompt_tokens_cached_by_source_total{source=...}: prompt tokens by where they came
  from (e.g. source="external_kv_transfer").
With --enable-prompt-tokens-details, a completion's usage.prompt_tokens_details.cached_tokens
says it per request.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from integrations.server_process import ServerProcess, launch, require_importable

ROOT = Path(__file__).resolve().parents[3]
SERVER_PYTHON = os.environ.get("HICACHE_VLLM_SERVER_PYTHON") or str(ROOT / ".venv-vllm-cpu" / "bin" / "python")
NEEDED = "vLLM's server is not importable: run `make test-vllm-cpu` (it builds .venv-vllm-cpu with `make vllm-cpu-env`)"

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
VOCAB = 512  # tiny_models' vocabulary

BLOCK = 32  # the tests' --block-size
BLOCKS = 12  # 11 usable: 352 tokens, so one 200-token prompt after another evicts


def require_vllm_server(python: str = SERVER_PYTHON) -> str:
    """`python`, once it imports vLLM's OpenAI server; else a skip of the module, or a failure
    where HICACHE_REQUIRE_ENGINES names vllm-server (`make test-vllm-cpu`). Not plain "vllm":
    `make test-vllm` requires that, and its .venv-vllm (vLLM --no-deps) cannot serve."""
    return require_importable(python, "vllm.entrypoints.openai.api_server", NEEDED, "vllm-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer(ServerProcess):
    """One running vLLM server (ServerProcess: url, log, tail, stop) of `model`."""

    model: str = ""
    started_s: float = 0.0  # seconds from launch to a healthy /health

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())  # type: ignore[no-any-return]

    def complete(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        """The greedy output ids for a token-id prompt."""
        return self.completion(prompt, max_tokens)["choices"][0]["token_ids"]  # type: ignore[no-any-return]

    def completion(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        """vLLM's whole /v1/completions answer (usage, prompt_token_ids, ...)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        return self.post("/v1/completions", body)

    def metrics(self) -> dict[str, float]:
        """Every /metrics sample, summed over its labels, by name."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                name = name.split("{", 1)[0]
                out[name] = out.get(name, 0.0) + float(value)
        return out


def start_vllm_server(
    model: str,
    log: Path,
    *,
    blocks: int,
    block_size: int = 32,
    max_model_len: int = 256,
    kv_cache_memory_bytes: int = 16 << 20,
    kv_transfer_config: dict[str, Any] | None = None,
    python: str = SERVER_PYTHON,
    timeout_s: float = 300.0,
    extra: tuple[str, ...] = (),
    tokenizer: bool = False,
    dtype: str = "bfloat16",
) -> VllmServer:
    """vLLM's OpenAI server for `model` (a folder) on a free loopback port, once /health
    answers. `blocks` KV blocks (num_gpu_blocks_override; one is vLLM's null block), so a
    prompt of more than (blocks - 1) * block_size tokens in flight evicts. `tokenizer`: load
    the folder's tokenizer (text prompts) instead of --skip-tokenizer-init. Raises
    RuntimeError, with the log's tail, when the server exits or is not healthy in time."""
    port = free_port()
    args = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--load-format", "auto", "--enforce-eager", "--dtype", dtype,
        "--block-size", str(block_size), "--num-gpu-blocks-override", str(blocks),
        "--kv-cache-memory-bytes", str(kv_cache_memory_bytes), "--max-model-len", str(max_model_len),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if not tokenizer:
        args.append("--skip-tokenizer-init")
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    base, took = launch([*args, *extra], log, port, health="/health", name="vLLM's server", timeout_s=timeout_s)
    return VllmServer(base.proc, base.url, base.log, model, took)


def prompt(seed: int, n: int) -> list[int]:
    """n random token ids (seeded), none of them pad, bos or eos (0-2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def hicache_config(target: str, **extra: object) -> dict[str, Any]:
    """The --kv-transfer-config of the README: HiCacheConnector on the sidecar at `target`,
    failed loads recomputed; `extra` adds kv_connector_extra_config keys (retry_s, ...)."""
    return {
        "kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": target, **extra},
    }


# a vLLM log line at INFO or DEBUG level ("INFO 12-07 01:02:03 [file.py:12] ...", perhaps after
# a process tag such as "(EngineCore_DP0 pid=12) ")
_QUIET = re.compile(r"^(\([^)]*\)\s*)?(INFO|DEBUG)\b")


def hicache_warnings(log_text: str) -> list[str]:
    """The lines of a server log that mention hicache and are not vLLM INFO/DEBUG lines:
    vLLM's own warnings and errors about it, and whatever hicache's loggers print (vLLM
    configures only its own loggers, so theirs reach stderr as bare messages)."""
    lines = log_text.replace("\r", "\n").splitlines()
    return [line for line in lines if "hicache" in line.lower() and not _QUIET.match(line.strip())]


ADMIN = "vllm-server-tests"  # the sidecars' --admin-token: stats of every pool


@dataclass
class Sidecar:
    """hicache-server on <sockdir>/hc.sock for a model folder, which tests start, kill and
    restart. `args` as tests/sidecar_util.start_sidecar takes them (a storage backend; by
    default the file tier in <sockdir>/tier, which a restart keeps)."""

    sockdir: str
    model: str
    page_size: int
    args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"unix://{self.sockdir}/hc.sock"

    def start(self, timeout_s: float = 120.0) -> None:
        """Start it and wait until its health service says SERVING. Raises RuntimeError."""
        from sidecar_util import start_sidecar

        from hicache.client.health import check_health

        config = Path(self.model) / "config.json"
        self.proc, _ = start_sidecar(
            self.sockdir, "--admin-token", ADMIN, *self.args, config=config, page_size=self.page_size
        )
        deadline = time.monotonic() + timeout_s
        while check_health(self.target) != "SERVING":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = self.proc.stdout.read().decode(errors="replace") if self.proc.poll() is not None else ""
                self.stop()
                raise RuntimeError(f"the sidecar did not start: {out[-2000:]}")
            time.sleep(0.1)

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: nothing is flushed or unlinked."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=60)

    def stop(self) -> None:
        """SIGTERM (in-flight work finishes), SIGKILL after 60 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def pools(self) -> list[Any]:
        """PoolStats of every pool registered now."""
        from hicache.client import HiCacheClient

        with HiCacheClient(self.target, admin_token=ADMIN, timeout=30) as client:
            return client.stats(all_pools=True)

    def wait_stored(self, tries: int = 600) -> None:
        """Until no pool has storage writes queued (tries x 0.1 s). Raises AssertionError."""
        for _ in range(tries):
            if all(p.storage_write_queue == 0 for p in self.pools()):
                return
            time.sleep(0.1)
        raise AssertionError(f"storage writes still queued: {self.pools()}")


def settle(server: VllmServer, sidecar: Sidecar, seed: int, rounds: int = 20) -> None:
    """After the sidecar (re)starts, until `server` stores pages in it again: its worker
    registers when the sidecar answers (every retry_s), and its scheduler refuses stores
    for retry_s after a lookup failed (the first ones meet the old pools). Each round
    serves a new 100-token prompt and waits a little for its store. Raises AssertionError."""
    for i in range(rounds):
        before = sum(p.used_pages for p in sidecar.pools())
        server.complete(prompt(seed + i, 100))
        for _ in range(10):
            if sum(p.used_pages for p in sidecar.pools()) > before:
                return
            time.sleep(0.1)
    raise AssertionError(f"{server.url} stored nothing in the sidecar after {rounds} prompts:\n{server.tail()}")


_ALONE = pytest.StashKey[VllmServer]()


def engine_alone(config: pytest.Config) -> VllmServer:
    """vLLM's server without hicache on the tiny Llama (BLOCKS blocks of BLOCK tokens),
    started once per pytest run and stopped at its end: the outputs every server with
    hicache must give."""
    if _ALONE not in config.stash:
        from tiny_models import llama

        folder = Path(tempfile.mkdtemp(prefix="vllm-alone-"))
        server = start_vllm_server(llama(folder / "model"), folder / "server.log", blocks=BLOCKS, block_size=BLOCK)
        config.stash[_ALONE] = server
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        config.add_cleanup(server.stop)
    return config.stash[_ALONE]
