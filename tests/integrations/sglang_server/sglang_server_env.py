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
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integrations.server_process import ServerProcess, launch, require_importable

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

    def generate(self, ids: list[int], max_new_tokens: int = 8) -> dict[str, Any]:
        """SGLang's whole /generate answer for a greedy token-id prompt."""
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
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


def start_sglang_server(
    model: str, log: Path, *, extra: tuple[str, ...] = (), python: str = SERVER_PYTHON, timeout_s: float = 300.0
) -> SglangServer:
    """SGLang's server for `model` on CPU with its hierarchical cache (host tier twice the
    device's), once /generate answers. Raises RuntimeError with the log's tail."""
    from integrations.vllm_server.vllm_server_env import free_port

    port = free_port()
    args = [
        python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--attention-backend", "torch_native", "--skip-tokenizer-init", "--disable-cuda-graph",
        "--page-size", str(PAGE), "--max-total-tokens", str(TOKENS), "--enable-hierarchical-cache",
        "--hicache-io-backend", "direct", "--hicache-ratio", "2", *extra,
    ]  # fmt: skip
    base, _ = launch(
        args, log, port, health="/health_generate", name="SGLang's server", timeout_s=timeout_s,
        env={**os.environ, **CPU_ENV}, poll_s=1.0, health_timeout_s=60.0,
    )  # fmt: skip
    return SglangServer(base.proc, base.url, base.log)


def cached(answer: dict[str, Any]) -> dict[str, int]:
    """Where a /generate answer's cached prompt tokens came from: device, host, storage."""
    details = answer["meta_info"].get("cached_tokens_details") or {}
    return {k: int(details.get(k) or 0) for k in ("device", "host", "storage")}
