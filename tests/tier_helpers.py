"""Helpers for storage-tier and hierarchy tests: small geometries, payloads, a redis-server."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from conftest import load_config
from helpers import redis_binary

from hicache.demo.redis_cluster import free_ports
from hicache.geometry import KVGeometry
from hicache.storage import Payload, StorageTier, TierHealth, TierIdentity
from hicache.storage.page_format import payload_parts


def small_geometries() -> dict[str, KVGeometry]:
    """K != V (MiMo-V2-Flash), MLA (DeepSeek-V3) and fp4, cut to 2 layers and 4-token pages."""
    out = {}
    for name, cfg, dtype in (
        ("mimo_kv", "mimo_v2_flash", "bfloat16"),
        ("deepseek_mla", "deepseek_v3", "bfloat16"),
        ("mimo_fp4", "mimo_v2_flash", "fp4_e2m1"),
    ):
        g = KVGeometry.from_hf_config(load_config(cfg), page_size=4, dtype=dtype)
        out[name] = KVGeometry(**dict(g.to_dict(), layer_num=2, layer_ids=g.layer_ids[:2]))
    assert out["mimo_kv"].head_dim != out["mimo_kv"].v_head_dim and out["deepseek_mla"].is_mla
    return out


GEOMETRIES = small_geometries()
GEOMETRY_NAMES = sorted(GEOMETRIES)


def identity(g: KVGeometry, namespace: str = "", model: str = "test-model@rev1") -> TierIdentity:
    return TierIdentity.for_geometry(g, model, namespace)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") + b"\x5a" * 28


def payload(g: KVGeometry, seed: int) -> bytes:
    return random.Random(seed).randbytes(g.page_bytes)


class RedisServer:
    """A private redis-server on a loopback port or a unix socket in a temporary folder."""

    def __init__(self, tmp: Path, unix: bool = False):
        exe = redis_binary()
        self.exe, self.tmp, self.unix = exe, tmp, unix
        self.sock = tmp / "redis.sock"
        self.port = 0 if unix else free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = False  # once started, the port never moves

    @property
    def url(self) -> str:
        return f"unix://{self.sock}" if self.unix else f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server. On its first start a TCP server whose port was taken meanwhile (it
        exits at once) moves to another port (url changes), up to twice; a restart keeps its
        port, as clients already hold the url."""
        for attempt in range(3):
            args = [self.exe, "--save", "", "--appendonly", "no", "--dir", str(self.tmp), "--port", str(self.port)]
            if self.unix:
                args += ["--unixsocket", str(self.sock), "--bind", "127.0.0.1"]
            else:
                args += ["--bind", "127.0.0.1"]
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 20
            while not self._ready():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            else:
                self.started = True
                return
            exited = self.proc.poll() is not None
            if not exited:
                self.proc.kill()
                self.proc.wait()
            if not exited or self.unix or self.started or attempt == 2:
                raise RuntimeError(f"redis-server did not start: {args}")
            self.port = free_port()

    def _ready(self) -> bool:
        """Whether our server answers: the process on the address is ours (its process_id),
        not another test's server that held the port first."""
        assert self.proc is not None
        try:
            with socket.socket(socket.AF_UNIX) if self.unix else socket.socket() as s:
                s.settimeout(1)
                s.connect(str(self.sock) if self.unix else ("127.0.0.1", self.port))
                s.sendall(b"INFO server\r\n")
                with s.makefile("rb") as reply:
                    head = reply.readline()  # a bulk string: $<length>, or an error before the server is up
                    if not head.startswith(b"$"):
                        return False
                    body = reply.read(int(head[1:]))
                return f"process_id:{self.proc.pid}\r\n".encode() in body
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.unix and self.sock.exists():
            os.unlink(self.sock)

    @staticmethod
    def flush(url: str) -> None:
        import redis

        with redis.Redis.from_url(url) as client:
            client.flushall()

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis.from_url(self.url)


def free_port() -> int:
    return free_ports(1, bus=False)[0]


class MemoryTier(StorageTier):
    """An in-memory tier for hierarchy tests. batch_get waits for `read_gate` and batch_set
    for `write_gate` (both open by default): a stub that only delays."""

    backend = "memory"

    def __init__(self, ident: TierIdentity):
        super().__init__(ident)
        self.pages: dict[bytes, bytes] = {}
        self.read_gate = threading.Event()
        self.write_gate = threading.Event()
        self.read_gate.set()
        self.write_gate.set()
        self.reads_started = threading.Semaphore(0)  # released once per batch_get call
        self.permits: threading.Semaphore | None = None  # if set, each batch_get takes one
        self.failures: list[bool] = []  # per batch_get call, in order: True raises OSError

    def contains(self, key: bytes) -> bool:
        return key in self.pages

    def get(self, key: bytes) -> memoryview | None:
        data = self.pages.get(key)
        return None if data is None else memoryview(data)

    def batch_get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        self.reads_started.release()
        assert self.read_gate.wait(60), "test forgot to open the read gate"
        if self.permits is not None:
            assert self.permits.acquire(timeout=60), "test forgot to release a permit"
        if self.failures and self.failures.pop(0):
            raise OSError("injected storage read failure")
        return [self.get(k) for k in keys]

    def set(self, key: bytes, data: Payload) -> bool:
        joined = b"".join(payload_parts(data))
        assert len(joined) == self.identity.page_bytes
        self.pages[key] = joined
        return True

    def batch_set(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]:
        assert self.write_gate.wait(60), "test forgot to open the write gate"
        return [self.set(k, d) for k, d in items]

    def delete(self, key: bytes) -> bool:
        return self.pages.pop(key, None) is not None

    def health(self) -> TierHealth:
        return TierHealth(True)
