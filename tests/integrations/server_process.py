"""An engine's real server as a subprocess, shared by the vLLM and SGLang server tests:
whether its environment can import it, its launch until a health URL answers, its log's tail,
and its stop (the whole process group: the engine's own workers too)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest


def require_importable(python: str, module: str, needed: str, engine: str, env: Mapping[str, str] | None = None) -> str:
    """`python`, once it imports `module`; else a skip of the calling module, or a failure
    where HICACHE_REQUIRE_ENGINES names `engine` (the make targets set it). `needed` says how
    to get it; `env` is added to the probe's environment."""
    try:
        probe = subprocess.run(
            [python, "-c", f"import {module}"],
            capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
        )  # fmt: skip
        why = probe.stderr.strip().splitlines()[-1:] if probe.returncode else None
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = [str(exc)]
    if why is not None:
        message = f"{needed} ({python}: {why[0] if why else 'failed'})"
        if engine in os.environ.get("HICACHE_REQUIRE_ENGINES", "").split(","):
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=True)
    return python


@dataclass
class ServerProcess:
    """One running server: `url` is http://127.0.0.1:<port>, `log` its stdout and stderr."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").replace("\r", "\n")
        return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT (the engine shuts down), then SIGKILL to the server's process group (its
        scheduler, engine core and worker processes too) after grace_s."""
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


def launch(
    args: Sequence[str],
    log: Path,
    port: int,
    *,
    health: str,
    name: str,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    poll_s: float = 0.5,
    health_timeout_s: float = 5.0,
) -> tuple[ServerProcess, float]:
    """Start `args` in a session of its own, output to `log`, and wait until GET `health`
    answers 200; returns the server and the seconds that took. Raises RuntimeError, with the
    log's tail, when it exits or is not healthy within timeout_s (it is stopped then)."""
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=None if env is None else dict(env),
        )
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log)
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{server.tail()}")
        try:
            with urllib.request.urlopen(server.url + health, timeout=health_timeout_s) as reply:
                if reply.status == 200:
                    return server, time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(poll_s)
    server.stop()
    raise RuntimeError(f"{name} was not healthy after {timeout_s:.0f} s:\n{server.tail()}")


class Completes(Protocol):
    def complete(self, ids: list[int]) -> list[int]: ...


class Reference:
    """The engine alone's greedy output of each prompt (8 tokens), asked once: of either
    engine's server (vLLM's or SGLang's, each with complete())."""

    def __init__(self, server: Completes):
        self.server = server
        self._outputs: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in self._outputs:
            self._outputs[key] = self.server.complete(ids)
        return self._outputs[key]
