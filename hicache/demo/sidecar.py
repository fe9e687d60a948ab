"""Run a sidecar (`hicache-server`) as a child process on a socket in a private folder."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hicache
from hicache.client.health import SERVING, check_health


def server_command() -> tuple[list[str], dict[str, str]]:
    """The command that runs the sidecar with this interpreter, and its environment: the
    installed package `hicache_server`, else `server/` of the checkout this hicache is in."""
    env = dict(os.environ)
    if importlib.util.find_spec("hicache_server") is not None:
        return [sys.executable, "-m", "hicache_server"], env
    root = Path(hicache.__file__).resolve().parent.parent
    if not (root / "server" / "app.py").is_file():
        raise RuntimeError(f"cannot find the sidecar: hicache_server is not installed and {root}/server is missing")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", "server"], env


class SidecarRefused(ValueError):
    """The sidecar exited before it served: its flags or its environment are wrong."""


class SidecarProcess:
    """A started sidecar; `target` is its gRPC address. Use as a context manager or call stop()."""

    def __init__(self, args: list[str], workdir: str):
        self.socket = os.path.join(workdir, "hicache.sock")
        self.target = f"unix://{self.socket}"
        self.log_path = os.path.join(workdir, "sidecar.log")
        cmd, env = server_command()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*cmd, "--socket", self.socket, *args], stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the health service says SERVING. Raises SidecarRefused (a ValueError:
        a bad flag, the sidecar's own one-line message) if it exits first, TimeoutError after
        `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                lines = [line for line in self.log_tail().splitlines() if line.strip()]
                last = lines[-1] if lines else f"exit status {self.proc.returncode}, no output"
                raise SidecarRefused(f"the sidecar did not start: {last.removeprefix('hicache-server: error: ')}")
            if os.path.exists(self.socket) and check_health(self.target, timeout=1.0) == SERVING:
                return
            time.sleep(0.1)
        raise TimeoutError(f"the sidecar was not SERVING after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after `timeout` s; returns the exit status. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
