"""SGLang's real server (`python -m sglang.launch_server`) as a subprocess, on CPU, with a
client for token-id prompts.

The server runs from .venv-sglang (`make sglang-env`, which also installs standins/ for
SGLang's CPU gaps), or from $HICACHE_SGLANG_SERVER_PYTHON, with SGLANG_USE_CPU_ENGINE=1 and
`--device cpu --attention-backend torch_native --hicache-io-backend direct`. Without a
tokenizer, /generate takes `input_ids`; its `meta_info.cached_tokens_details` says where the
prompt's cached tokens came from (`device`, `host`, `storage`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from integrations.server_process import ServerProcess, launch, require_importable
from integrations.vllm_server.vllm_server_env import Sidecar, prompt

ROOT = Path(__file__).resolve().parents[3]
SERVER_PYTHON = os.environ.get("HICACHE_SGLANG_SERVER_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
NEEDED = "SGLang's server is not importable: run `make test-sglang` (it builds .venv-sglang with `make sglang-env`)"
PAGE = 16  # the tests' --page-size
TOKENS = 256  # --max-total-tokens: one 160-token prompt after another evicts from the device
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}


def require_sglang_server(python: str = SERVER_PYTHON) -> str:
    """`python`, once it imports SGLang's HTTP server; else a skip of the module, or a failure
    where HICACHE_REQUIRE_ENGINES names sglang-server (`make test-sglang`)."""
    return require_importable(python, "sglang.srt.entrypoints.http_server", NEEDED, "sglang-server", CPU_ENV)


def hicache_args(target: str, **extra: object) -> tuple[str, ...]:
    """The README's flags for hicache as SGLang's L3 (`dynamic` backend, shm host pool), with a
    prefetch threshold of one page (SGLang's default, 256 tokens, would never fetch here)."""
    config = {
        "backend_name": "hicache",
        "module_path": "hicache.integrations.sglang",
        "class_name": "HiCacheSidecarStorage",
        "interface_v1": 1,
        "allocator": "shm",
        "target": target,
        "prefetch_threshold": PAGE,
        **extra,
    }
    return (
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(config),
    )  # fmt: skip


@dataclass
class SglangServer(ServerProcess):
    """One running SGLang server (ServerProcess: url, log, tail, stop)."""

    started_s: float = 0.0  # seconds from launch to a healthy /health_generate

    def generate(self, ids: list[int], max_new_tokens: int = 8, **sampling: object) -> dict[str, Any]:
        """SGLang's whole /generate answer for a greedy token-id prompt; `sampling` adds
        sampling_params (ignore_eos, ...)."""
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **sampling}}
        request = urllib.request.Request(
            self.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            return json.loads(reply.read())  # type: ignore[no-any-return]

    def complete(self, ids: list[int]) -> list[int]:
        return self.generate(ids)["output_ids"]  # type: ignore[no-any-return]

    def flush(self) -> None:
        """SGLang's /flush_cache: empties its device and host tiers (not the L3)."""
        with urllib.request.urlopen(urllib.request.Request(self.url + "/flush_cache", method="POST"), timeout=60):
            pass


# SGLang's own log format has no level; through SGLANG_LOGGING_CONFIG_PATH (SGLang's setting
# for a logging.config.dictConfig) the tests' servers write each line's level and logger
LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"
_LEVELLED = re.compile(r"^\[[^\]]*\] (WARNING|ERROR|CRITICAL) ")


def logging_config(folder: Path) -> Path:
    """A dictConfig file for SGLANG_LOGGING_CONFIG_PATH: LOG_FORMAT on stderr, level INFO."""
    path = folder / "sglang-logging.json"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"levelled": {"format": LOG_FORMAT, "datefmt": "%Y-%m-%d %H:%M:%S"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "levelled"}},
        "root": {"level": "INFO", "handlers": ["stderr"]},
    }
    path.write_text(json.dumps(config))
    return path


def hicache_warnings(log_text: str) -> list[str]:
    """The WARNING, ERROR and CRITICAL lines of a server log (written in LOG_FORMAT) that
    mention hicache: hicache's own, and SGLang's about it."""
    lines = log_text.replace("\r", "\n").splitlines()
    return [line for line in lines if _LEVELLED.match(line) and "hicache" in line.lower()]


def start_sglang_server(
    model: str,
    log: Path,
    *,
    extra: tuple[str, ...] = (),
    python: str = SERVER_PYTHON,
    timeout_s: float = 300.0,
    tokens: int = TOKENS,
    page: int = PAGE,
    host_ratio: float | None = 2.0,
    levelled: bool = False,
    tokenizer: bool = False,
) -> SglangServer:
    """SGLang's server for `model` on CPU, `tokens` tokens in its device pool
    (--max-total-tokens) in pages of `page`, once /generate answers. Its hierarchical cache
    has a host tier of `host_ratio` times the device's (None: no hierarchical cache, SGLang's
    radix cache alone). `levelled`: its log lines in LOG_FORMAT. Raises RuntimeError with
    the log's tail. `tokenizer`: load the folder's tokenizer (text prompts, /v1/completions)
    instead of --skip-tokenizer-init."""
    from integrations.vllm_server.vllm_server_env import free_port

    port = free_port()
    args = [
        python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
        "--page-size", str(page), "--max-total-tokens", str(tokens),
    ]  # fmt: skip
    if not tokenizer:
        args.append("--skip-tokenizer-init")
    if host_ratio is not None:
        args += ["--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-ratio", f"{host_ratio:g}"]
    args += extra
    env = {**os.environ, **CPU_ENV}
    if levelled:
        env["SGLANG_LOGGING_CONFIG_PATH"] = str(logging_config(log.parent))
    base, took = launch(
        args, log, port, health="/health_generate", name="SGLang's server", timeout_s=timeout_s,
        env=env, poll_s=1.0, health_timeout_s=60.0,
    )  # fmt: skip
    return SglangServer(base.proc, base.url, base.log, took)


def cached(answer: dict[str, Any]) -> dict[str, int]:
    """Where a /generate answer's cached prompt tokens came from: device, host, storage."""
    details = answer["meta_info"].get("cached_tokens_details") or {}
    return {k: int(details.get(k) or 0) for k in ("device", "host", "storage")}


def used_pages(sidecar: Sidecar) -> int:
    """Pages held in the sidecar's host memory, over every pool."""
    return sum(p.used_pages for p in sidecar.pools())


def wait_held(sidecar: Sidecar, before: int, pages: int, tries: int = 300) -> None:
    """Until the sidecar holds `pages` more host pages than `before` (SGLang backs pages up
    to its L3 in the background). Raises AssertionError after tries x 0.1 s."""
    for _ in range(tries):
        if used_pages(sidecar) >= before + pages:
            return
        time.sleep(0.1)
    raise AssertionError(f"the sidecar holds {used_pages(sidecar)} pages, not {before} + {pages}")


def settle(server: SglangServer, sidecar: Sidecar, seed: int, rounds: int = 20) -> None:
    """After the sidecar (re)starts, until `server` stores pages in it again: its adapter
    registers when the sidecar answers (a pool down at start-up: every second; a pool the
    sidecar forgot: at the next call, which still misses). Each round serves a new 64-token
    prompt and waits a little for its pages. Raises AssertionError."""
    for i in range(rounds):
        before = used_pages(sidecar)
        server.complete(prompt(seed + i, 64))
        for _ in range(20):
            if used_pages(sidecar) > before:
                return
            time.sleep(0.1)
    raise AssertionError(f"{server.url} stored nothing in the sidecar after {rounds} prompts:\n{server.tail()}")


_ALONE = pytest.StashKey[SglangServer]()


def engine_alone(config: pytest.Config) -> SglangServer:
    """SGLang's server without an L3 on the tiny Llama, started once per pytest run and
    stopped at its end: the outputs every server with hicache must give."""
    if _ALONE not in config.stash:
        from integrations.vllm_server.tiny_models import llama

        folder = Path(tempfile.mkdtemp(prefix="sglang-alone-"))
        server = start_sglang_server(llama(folder / "model"), folder / "alone.log")
        config.stash[_ALONE] = server
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        config.add_cleanup(server.stop)
    return config.stash[_ALONE]
