"""A throwaway Redis Cluster on loopback ports: masters and replicas started with
`redis-server --cluster-enabled yes` and joined by `redis-cli --cluster create`.

The two-node demo, the cluster tests and the tier benchmark use it; a real deployment
points hicache at its own cluster instead.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hicache.demo.loopback_ports import _ephemeral_low, free_ports  # noqa: F401 - tests import _ephemeral_low from here


@dataclass
class ClusterNode:
    port: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalRedisCluster:
    """`masters` masters with `replicas` replicas each, in `folder`; a node silent for
    `node_timeout_ms` counts as failed (its replica takes over). start() blocks until every
    slot is served (raises RuntimeError naming the step that failed, or FileNotFoundError when
    redis-server / redis-cli are not installed); stop() kills them all. A context manager.
    `ports`: the nodes' ports, already wired into something else (then a node whose port was
    taken fails the start instead of moving); by default free_ports() picks them."""

    def __init__(
        self,
        folder: str | Path,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 5000,
        ports: list[int] | None = None,
    ):
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        for exe in ("redis-server", "redis-cli"):
            if shutil.which(exe) is None:
                raise FileNotFoundError(f"{exe} is not installed (apt-get install redis-server)")
        self.folder = Path(folder)
        self.masters, self.replicas, self.node_timeout_ms = masters, replicas, node_timeout_ms
        count = masters * (1 + replicas)
        if ports is not None and len(ports) != count:
            raise ValueError(f"{masters} masters and {masters * replicas} replicas need {count} ports, got {ports}")
        self.fixed = ports is not None
        self.nodes = [ClusterNode(port, self.folder / str(port)) for port in ports or free_ports(count)]

    @property
    def url(self) -> str:
        """A startup node's URL (any node will do: the client learns the rest)."""
        return f"redis://{self.nodes[0].address}"

    @property
    def urls(self) -> list[str]:
        return [f"redis://{n.address}" for n in self.nodes]

    def start(self, timeout_s: float = 60.0) -> LocalRedisCluster:
        for node in self.nodes:
            self._spawn(node)
        for i, node in enumerate(self.nodes):
            self.nodes[i] = self._wait_started(node, timeout_s)
        addresses = [n.address for n in self.nodes]
        self._cli("--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas), "--cluster-yes")
        self.wait_ok(timeout_s)
        self.wait_replicas(timeout_s)
        return self

    def wait_replicas(self, timeout_s: float = 60.0) -> None:
        """Until every live replica has finished its first sync (a replica that has not cannot
        take over from its master)."""
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = [
                n
                for n in self.nodes
                if n.alive
                and "role:slave" in (text := self._cli("info", "replication", node=n))
                and "master_link_status:up" not in text
            ]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis replicas on {[n.port for n in waiting]} not in sync after {timeout_s} s")
            time.sleep(0.05)

    def _spawn(self, node: ClusterNode) -> None:
        node.folder.mkdir(parents=True, exist_ok=True)
        args = [
            "redis-server",
            "--port", str(node.port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(node.folder / "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-require-full-coverage", "no",
            "--dir", str(node.folder),
            "--save", "",
            "--appendonly", "no",
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        log = open(node.folder / "redis.log", "ab")  # noqa: SIM115 - the child holds it
        node.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _wait_started(self, node: ClusterNode, timeout_s: float, tries: int = 3) -> ClusterNode:
        """`node`, or a node on new ports in its place when another process bound its port (or
        its bus port) after free_ports() found it free."""
        for _ in range(tries):
            if _wait_ping(node, timeout_s):
                return node
            log = node.folder / "redis.log"
            if self.fixed or b"Address already in use" not in log.read_bytes():
                break
            taken = {n.port for n in self.nodes}
            port = free_ports(1)[0]
            while port in taken:
                port = free_ports(1)[0]
            node = ClusterNode(port, self.folder / str(port))
            self._spawn(node)
        raise RuntimeError(f"redis-server on port {node.port} did not start (log: {node.folder / 'redis.log'})")

    def _cli(self, *args: str, node: ClusterNode | None = None, timeout_s: float = 120.0) -> str:
        target = node or self._live()
        done = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(target.port), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0 or "[ERR]" in done.stdout:
            raise RuntimeError(f"redis-cli {' '.join(args)} failed: {done.stdout[-500:]}{done.stderr[-500:]}")
        return done.stdout

    def info(self, node: ClusterNode) -> dict[str, str]:
        """CLUSTER INFO of one node as a dict."""
        text = self._cli("cluster", "info", node=node)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def _live(self) -> ClusterNode:
        return next(n for n in self.nodes if n.alive)

    def slot_owners(self, node: ClusterNode) -> set[int]:
        """Ports of the masters that serve slots, as `node` sees them."""
        owners = set()
        for line in self._cli("cluster", "nodes", node=node).splitlines():
            fields = line.split()
            if len(fields) > 8 and "master" in fields[2]:
                owners.add(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        return owners

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every live node says cluster_state:ok, all 16384 slots are served, and every
        master that serves slots is alive (after a kill, until its replica took over)."""
        deadline = time.monotonic() + timeout_s
        alive = {n.port for n in self.nodes if n.alive}
        while True:
            try:
                live = [n for n in self.nodes if n.alive]
                infos = [self.info(n) for n in live]
                if all(i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384" for i in infos) and all(
                    self.slot_owners(n) <= alive for n in live
                ):
                    return
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster in {self.folder} not ok after {timeout_s} s")
            time.sleep(0.1)

    def roles(self) -> dict[int, str]:
        """port -> "master" or "slave", as the live nodes see themselves."""
        out = {}
        for node in self.nodes:
            if node.alive:
                text = self._cli("role", node=node)
                out[node.port] = text.split()[0]
        return out

    def master_ports(self) -> list[int]:
        return [port for port, role in self.roles().items() if role == "master"]

    def kill(self, port: int) -> None:
        """SIGKILL one node (its replica takes over after the node timeout)."""
        node = next(n for n in self.nodes if n.port == port)
        if node.proc is not None:
            node.proc.kill()
            node.proc.wait()

    def node_id(self, port: int) -> str:
        node = next(n for n in self.nodes if n.port == port)
        return self._cli("cluster", "myid", node=node).strip()

    def reshard(self, from_port: int, to_port: int, slots: int) -> None:
        """Move `slots` slots (and their keys) from one master to another, as an operator would
        (once every node agrees on the slot map: redis-cli refuses to reshard before)."""
        self.wait_agreed()
        self._cli(
            "--cluster", "reshard", self._live().address,
            "--cluster-from", self.node_id(from_port),
            "--cluster-to", self.node_id(to_port),
            "--cluster-slots", str(slots),
            "--cluster-yes",
        )  # fmt: skip

    def wait_agreed(self, timeout_s: float = 60.0) -> None:
        """Until `redis-cli --cluster check` finds every node agreeing on the configuration."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._cli("--cluster", "check", self._live().address)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def flush(self) -> None:
        """Delete every key on every live master."""
        for port in self.master_ports():
            self._cli("flushall", node=next(n for n in self.nodes if n.port == port))

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive:
                assert node.proc is not None
                node.proc.kill()
                node.proc.wait()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_ping(node: ClusterNode, timeout_s: float) -> bool:
    """True once the node answers PING; False when it exited first. Raises after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", node.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return True
        except OSError:
            pass
        if not node.alive:
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"redis-server on port {node.port} did not answer in {timeout_s} s (log: {node.folder / 'redis.log'})"
            )
        time.sleep(0.02)
