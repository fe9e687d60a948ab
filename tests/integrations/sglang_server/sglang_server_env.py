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
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERVER_PYTHON = os.environ.get("HICACHE_SGLANG_SERVER_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
NEEDED = "SGLang's server is not importable: run `make test-sglang` (it builds .venv-sglang with `make sglang-env`)"
PAGE = 16  # the tests' --page-size
TOKENS = 256  # --max-total-tokens: one 160-token prompt after another evicts from the device
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}


def require_sglang_server(python: str = SERVER_PYTHON) -> str:
    """`python`, once it imports SGLang's HTTP server; else a skip of the module, or a failure
    where HICACHE_REQUIRE_ENGINES names sglang-server (`make test-sglang`)."""
    try:
        probe = subprocess.run(
            [python, "-c", "import sglang.srt.entrypoints.http_server"],
            capture_output=True, text=True, timeout=300, env={**os.environ, **CPU_ENV},
        )  # fmt: skip
        why = probe.stderr.strip().splitlines()[-1:] if probe.returncode else None
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = [str(exc)]
    if why is not None:
        message = f"{NEEDED} ({python}: {why[0] if why else 'failed'})"
        if "sglang-server" in os.environ.get("HICACHE_REQUIRE_ENGINES", "").split(","):
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=True)
    return python


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
class SglangServer:
    """One running server: `url` is http://127.0.0.1:<port>, `log` its stdout and stderr."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

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

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").replace("\r", "\n")
        return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT, then SIGKILL to the server's process group (its scheduler too)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


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
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **CPU_ENV}
        )
    server = SglangServer(proc, f"http://127.0.0.1:{port}", log)
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang's server exited with {proc.returncode}:\n{server.tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health_generate", timeout=60) as reply:
                if reply.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"SGLang's server was not healthy after {timeout_s:.0f} s:\n{server.tail()}")


def cached(answer: dict[str, Any]) -> dict[str, int]:
    """Where a /generate answer's cached prompt tokens came from: device, host, storage."""
    details = answer["meta_info"].get("cached_tokens_details") or {}
    return {k: int(details.get(k) or 0) for k in ("device", "host", "storage")}
