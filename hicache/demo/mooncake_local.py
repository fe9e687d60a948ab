"""A throwaway Mooncake Store master on loopback, and the network namespace it runs in.

Every Mooncake client opens listeners of its own (transfer and handshake ports) that a
test or benchmark should not expose, so the Mooncake tests and `benchmarks/tiers.py
--backend mooncake` first move into a network namespace that has only loopback
(enter_loopback_namespace, as root), then start the master and clients in it. A real
deployment points hicache at its own Mooncake cluster instead.
"""

from __future__ import annotations

import ctypes
import fcntl
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hicache.demo.loopback_ports import free_ports

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def only_loopback() -> bool:
    """Whether this process's network namespace has no interface but `lo`."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def enter_loopback_namespace() -> None:
    """Move this thread (and the processes and threads it starts from now on) into a new
    network namespace with only loopback, and bring `lo` up. No-op where that is already
    so. Raises OSError naming what to do when the kernel refuses (not root)."""
    if not only_loopback():
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(
                err,
                "cannot make a loopback-only network namespace for Mooncake (run as root, or under `unshare -rn`)",
            )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH", b"lo", 0)
        (flags,) = struct.unpack_from("H", fcntl.ioctl(s, SIOCGIFFLAGS, ifr), 16)
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def master_binary() -> str:
    """The mooncake_master that the mooncake package installed beside this Python, or one
    on PATH. Raises FileNotFoundError saying how to get it."""
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if not found:
        raise FileNotFoundError(
            "mooncake_master is not installed: pip install mooncake-transfer-engine-non-cuda "
            "(and apt-get install libibverbs1)"
        )
    return found


class LocalMooncakeMaster:
    """One mooncake_master on 127.0.0.1 (RPC and metrics ports picked free), logging into
    `folder`. start() blocks until its /health answers and its RPC port accepts; stop() kills it, and a later start()
    is a restarted master on the same ports, which has lost every object. A context manager."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port, self.metrics_port = free_ports(2, bus=False)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def extra_config(self, **more: object) -> dict[str, object]:
        """A mooncake backend's extra config for this master: small segments for tests."""
        return {"master_server_address": self.address, "global_segment_size": "256mb", **more}

    def start(self, timeout_s: float = 30.0) -> None:
        self.starts += 1
        log = open(self.folder / f"master-{self.starts}.log", "wb")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(
            [
                master_binary(),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.port}",
                "--enable_http_metadata_server=false",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: see {self.folder}")
            try:  # /health answers a few ms before the RPC port accepts: wait for both
                with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1) as reply:
                    healthy = reply.status == 200
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    if healthy:
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not answer /health within {timeout_s}s: see {self.folder}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> LocalMooncakeMaster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
