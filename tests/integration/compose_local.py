"""Run a docker-compose.yml as local processes: the same commands, environments, healthchecks
and dependency order, without Docker.

What stands in for the containers:
- Programs: the image's ENTRYPOINT/CMD and ENV come from the Dockerfile; `hicache-server`
  and `hicache` run from this checkout with this interpreter; other programs (redis-server,
  redis-cli) from PATH.
- Files: every named volume is one temporary folder, shared by the services that mount it;
  a container path in a command or a variable is rewritten to its folder. /app (the image's
  WORKDIR, where the Dockerfile copies the repository) is the repository root.
- Network: every port a service exposes gets a free loopback port; "service:port" and the
  service's own "--port N" / "=N" become it.
- Profiles: as `docker compose --profile P`, a service with `profiles` runs only when one of
  them is given.
- A service marked `x-local: redis-cluster` (a cluster of redis-server nodes in one container)
  runs as hicache.demo.redis_cluster.LocalRedisCluster: the same redis-server nodes and
  `redis-cli --cluster create`, on the loopback ports its exposed ports map to.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hicache.demo.redis_cluster import LocalRedisCluster, free_ports

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = {"hicache-server": [sys.executable, "-m", "server"], "hicache": [sys.executable, "-m", "hicache.cli"]}


def read_compose(path: Path) -> dict[str, Any]:
    """A compose file as its users get it: each `${VAR:-default}` is its default (CI sets some of
    these variables to local images; the local run and the checks follow the file's defaults)."""
    text = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", path.read_text())
    if re.search(r"(?<!\$)\$\{", text):
        raise ValueError(f"{path}: a ${{VAR}} without a default: {re.findall(r'[$][{][^}]*[}]', text)}")
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def dockerfile_image(path: Path) -> dict[str, Any]:
    """ENTRYPOINT, CMD (exec form), ENV and WORKDIR of a Dockerfile (the last of each)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out: dict[str, Any] = {"entrypoint": [], "cmd": [], "env": {}, "workdir": "/"}
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "ENTRYPOINT":
            out["entrypoint"] = json.loads(rest)
        elif word == "CMD":
            out["cmd"] = json.loads(rest)
        elif word == "WORKDIR":
            out["workdir"] = rest.strip()
        elif word == "ENV":
            out["env"].update(dict(item.split("=", 1) for item in shlex.split(rest)))
    return out


def _listify(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


@dataclass
class Service:
    name: str
    spec: dict[str, Any]
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)  # container path -> local path
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    cluster: LocalRedisCluster | None = None  # an x-local: redis-cluster service


class LocalCompose:
    """Start services in dependency order (waiting on healthchecks as depends_on says), then
    wait for the first to exit, stop the rest, and return that exit status."""

    def __init__(self, compose: dict[str, Any], image: dict[str, Any], workdir: Path, profiles: tuple[str, ...] = ()):
        self.compose, self.image, self.workdir = compose, image, workdir
        self.paths: dict[str, str] = {image["workdir"]: str(ROOT)}
        for vol in compose.get("volumes") or {}:
            self.paths[f"volume:{vol}"] = tempfile.mkdtemp(prefix=f"{vol}-", dir=workdir)
        specs = {
            name: spec
            for name, spec in compose["services"].items()
            if not spec.get("profiles") or set(spec["profiles"]) & set(profiles)
        }
        self.ports: dict[tuple[str, str], int] = {}
        clusters = {}
        exposed_of = {
            name: [str(e).rsplit(":", 1)[-1] for e in [*(spec.get("expose") or []), *(spec.get("ports") or [])]]
            for name, spec in specs.items()
        }
        free = iter(free_ports(sum(map(len, exposed_of.values()))))  # one draw: no two services share a port
        for name, spec in specs.items():
            exposed = exposed_of[name]
            local_ports = [next(free) for _ in exposed]
            if spec.get("x-local") == "redis-cluster":
                clusters[name] = LocalRedisCluster(workdir / name, ports=local_ports)
            self.ports.update({(name, port): local for port, local in zip(exposed, local_ports, strict=True)})
        self.services = {name: self._service(name, spec) for name, spec in specs.items()}
        for name, cluster in clusters.items():
            self.services[name].cluster = cluster

    # ---- translating one service ---------------------------------------------------------------
    def _service(self, name: str, spec: dict[str, Any]) -> Service:
        mounts = {}
        for entry in spec.get("volumes") or []:
            source, target = str(entry).split(":")[:2]
            mounts[target] = self.paths[f"volume:{source}"] if f"volume:{source}" in self.paths else source
        from_image = "image" in spec or "build" in spec
        entrypoint = _listify(spec["entrypoint"]) if "entrypoint" in spec else self.image["entrypoint"]
        command = _listify(spec["command"]) if "command" in spec else self.image["cmd"]
        if spec.get("image", "").startswith("redis"):
            entrypoint = []  # the redis image's entrypoint only drops privileges
        env = dict(self.image["env"]) if from_image and not spec.get("image", "").startswith("redis") else {}
        env.update({k: str(v) for k, v in (spec.get("environment") or {}).items()})
        sub = {**self.paths, **mounts}
        argv = [self._rewrite(name, a, sub) for a in [*entrypoint, *command]]
        env = {k: self._rewrite(name, v, sub) for k, v in env.items()}
        return Service(name, spec, self._program(argv), env, sub)

    def _rewrite(self, service: str, value: str, paths: dict[str, str]) -> str:
        for (owner, port), local in self.ports.items():
            value = value.replace(f"{owner}:{port}", f"127.0.0.1:{local}")
            if owner == service and (value == port or value.endswith(f"={port}")):
                value = value[: len(value) - len(port)] + str(local)
        for target in sorted((t for t in paths if t.startswith("/")), key=len, reverse=True):
            value = re.sub(rf"(?<![\w/]){re.escape(target)}(?=/|\b|$)", paths[target], value)
        return value

    @staticmethod
    def _program(argv: list[str]) -> list[str]:
        return PROGRAMS.get(argv[0], [argv[0]]) + argv[1:] if argv else argv

    # ---- running --------------------------------------------------------------------------
    def order(self) -> list[str]:
        """Services in dependency order. Raises ValueError for a cycle or an unknown service."""
        done: list[str] = []

        def visit(name: str, path: tuple[str, ...]) -> None:
            if name in done:
                return
            if name in path or name not in self.services:
                raise ValueError(f"bad depends_on at {' -> '.join((*path, name))}")
            for dep in self.services[name].spec.get("depends_on") or {}:
                visit(dep, (*path, name))
            done.append(name)

        for name in self.services:
            visit(name, ())
        return done

    def start(self, name: str) -> None:
        s = self.services[name]
        if s.cluster is not None:
            s.cluster.start()
            return
        s.log = self.workdir / f"{name}.log"
        env = {**os.environ, **s.env, "PYTHONPATH": str(ROOT)}
        with open(s.log, "wb") as log:
            s.proc = subprocess.Popen(s.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def healthy(self, name: str) -> bool:
        s = self.services[name]
        if s.cluster is not None:
            return True  # start() returned once every slot was served and every replica in sync
        test = _listify((s.spec.get("healthcheck") or {}).get("test"))
        if not test:
            raise ValueError(f"service {name} has no healthcheck but a dependant waits for service_healthy")
        if test[0] not in ("CMD", "CMD-SHELL"):
            raise ValueError(f"unsupported healthcheck {test}")
        argv = self._program([self._rewrite(name, a, s.paths) for a in test[1:]])
        if test[0] == "CMD-SHELL":
            argv = ["sh", "-c", " ".join(argv)]
        env = {**os.environ, **s.env, "PYTHONPATH": str(ROOT)}
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=30).returncode == 0

    def wait_for(self, dep: str, condition: str, timeout: float) -> None:
        s = self.services[dep]
        if s.cluster is not None:
            return
        assert s.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = s.proc.poll()
            if condition == "service_completed_successfully" and rc is not None:
                if rc != 0:
                    raise RuntimeError(f"{dep} exited {rc}:\n{self.tail(dep)}")
                return
            if rc is not None:
                raise RuntimeError(f"{dep} exited {rc} before it was {condition}:\n{self.tail(dep)}")
            if condition == "service_started" or (condition == "service_healthy" and self.healthy(dep)):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{dep} not {condition} after {timeout} s:\n{self.tail(dep)}")

    def up(self, timeout: float = 300.0) -> tuple[str, int]:
        """Like `docker compose up --abort-on-container-exit`: (first service to exit, its status)."""
        try:
            for name in self.order():
                deps = self.services[name].spec.get("depends_on") or {}
                for dep, cond in deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps):
                    self.wait_for(dep, (cond or {}).get("condition", "service_started"), timeout)
                self.start(name)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for name, s in self.services.items():
                    if s.proc is not None and s.proc.poll() is not None:
                        return name, s.proc.returncode
                time.sleep(0.2)
            raise TimeoutError(f"no service exited within {timeout} s")
        finally:
            self.down()

    def run(self, name: str, timeout: float = 300.0) -> int:
        """Like `docker compose run NAME`: start what NAME depends on (waiting as depends_on
        says), then NAME; its exit status once it exits."""
        needed: set[str] = set()

        def need(service: str) -> None:
            if service not in needed:
                needed.add(service)
                for dep in self.services[service].spec.get("depends_on") or {}:
                    need(dep)

        need(name)
        try:
            for service in (s for s in self.order() if s in needed):
                deps = self.services[service].spec.get("depends_on") or {}
                for dep, cond in deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps):
                    self.wait_for(dep, (cond or {}).get("condition", "service_started"), timeout)
                self.start(service)
            proc = self.services[name].proc
            assert proc is not None
            return proc.wait(timeout)
        finally:
            self.down()

    def down(self, grace: float = 30.0) -> None:
        for s in reversed(list(self.services.values())):
            if s.proc is not None and s.proc.poll() is None:
                s.proc.terminate()
                try:
                    s.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    s.proc.wait()
        for s in self.services.values():
            if s.cluster is not None:
                s.cluster.stop()

    def tail(self, name: str, lines: int = 40) -> str:
        log = self.services[name].log
        if log is None or not log.exists():
            return "(no output)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
