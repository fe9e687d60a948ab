"""A compose project under a real Docker engine, for the tests: `docker compose -p NAME -f FILE`.

The environment is the test's own: deploy/docker-ci.sh (CI, `make test-compose`) sets
HICACHE_PYTHON_IMAGE and HICACHE_REDIS_IMAGE to its local base images, and
HICACHE_REQUIRE_DOCKER=1, under which a missing engine fails a test instead of skipping it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest

from hicache.demo.loopback_ports import free_ports

from .compose_local import ROOT


def docker_missing() -> str | None:
    """Why no Docker engine with the compose plugin answers, or None when one does."""
    if shutil.which("docker") is None:
        return "no docker command on PATH"
    for probe in (["docker", "info"], ["docker", "compose", "version"]):
        r = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return f"`{' '.join(probe)}` exited {r.returncode}: {r.stderr.strip()[-300:]}"
    return None


def require_docker() -> None:
    """Skip without a Docker engine; fail instead under HICACHE_REQUIRE_DOCKER=1."""
    missing = docker_missing()
    if missing is None:
        return
    if os.environ.get("HICACHE_REQUIRE_DOCKER") == "1":
        pytest.fail(f"HICACHE_REQUIRE_DOCKER=1 and no Docker engine: {missing}")
    pytest.skip(f"no reachable Docker engine with the compose plugin: {missing}")


class Project:
    """One compose project (its own containers, networks and volumes), removed by down()."""

    def __init__(
        self,
        name: str,
        files: Sequence[Path] = (ROOT / "docker-compose.yml",),
        profiles: Sequence[str] = (),
        **env: str,
    ) -> None:
        self.base = ["docker", "compose", "-p", name, *(a for f in files for a in ("-f", str(f)))]
        self.base += [a for p in profiles for a in ("--profile", p)]
        self.env = {**os.environ, **env}

    def __call__(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `docker compose ARGS`; with check, a non-zero exit raises with its output."""
        r = subprocess.run([*self.base, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(
                f"docker compose {' '.join(args)} exited {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
            )
        return r

    def down(self) -> None:
        """Remove every service, of every profile (a plain `down` leaves those of profiles it
        was not given), its networks and volumes."""
        self("--profile", "*", "down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=300)

    def published(self, service: str, port: int) -> tuple[str, int]:
        """The host address a service's port is published on (`docker compose port`)."""
        out = self("port", service, str(port)).stdout.strip()
        host, _, host_port = out.rpartition(":")
        return host, int(host_port)

    def logs(self, service: str) -> str:
        return self("logs", "--no-color", service, check=False).stdout


def host_ports(*names: str) -> dict[str, str]:
    """A distinct free loopback port for each variable name (compose publishes on them)."""
    return dict(zip(names, map(str, free_ports(len(names), bus=False)), strict=True))


def scrape(host: str, port: int) -> dict[str, float]:
    """Prometheus text from http://HOST:PORT/metrics: each sample's `name{labels}` -> value."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            samples[m.group(1)] = float(m.group(2))
    return samples


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and all(w in k for w in want))


def wait_http(url: str, timeout_s: float = 900.0) -> None:
    """Until GET url answers 200. Raises AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=60) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s} s")


def tiny_model() -> str:
    """The real-server tests' tiny seeded Llama (tiny_models.llama) in a new folder that the
    containers' uid 1000 can read; returns the model folder."""
    from integrations.vllm_server.tiny_models import llama

    folder = Path(tempfile.mkdtemp(prefix="hicache-compose-model-"))
    model = Path(llama(folder / "model"))
    for path in (folder, model, *model.iterdir()):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return str(model)


S = TypeVar("S")


@contextmanager
def engine_stack(
    name: str,
    files: Sequence[Path],
    profiles: Sequence[str],
    ports: Sequence[str],
    make: Callable[[Project, str], S],
    health: Callable[[S], Sequence[str]],
    logs: Mapping[str, int],
) -> Iterator[S]:
    """An engine profile's project on the tiny model, running: `up -d --build --wait` with a
    free loopback port for each variable in `ports` and HICACHE_METRICS_HOST_PORT, then
    make(project, up's output) once every URL health(stack) names answers 200. On the way
    out, the last `logs[service]` characters of each service's log are printed (pytest shows
    them when a test failed), the project is taken down and the model folder removed."""
    require_docker()
    model = tiny_model()
    env = host_ports(*ports, "HICACHE_METRICS_HOST_PORT")
    project = Project(name, files, profiles, MODEL=model, **env)
    project.down()  # what an interrupted earlier run left
    try:
        up = project("up", "-d", "--build", "--wait", timeout=2400)
        stack = make(project, up.stdout + up.stderr)
        for url in health(stack):
            wait_http(url)
        yield stack
    finally:
        print(*(project.logs(service)[-chars:] for service, chars in logs.items()))
        project.down()
        shutil.rmtree(Path(model).parent, ignore_errors=True)
