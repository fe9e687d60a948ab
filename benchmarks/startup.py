"""Sidecar start-up and idle footprint, against a bare gRPC server in the same run.

    python benchmarks/startup.py [--runs 5] [--json]

Each run starts a process and polls the gRPC health service on its Unix socket every 10 ms
until it answers SERVING: `hicache-server` (no storage tier, no pool), and a bare Python gRPC
server with only the health service ("echo", the floor: the interpreter, grpcio and a socket).
Reported: the median time to SERVING, the process's resident memory once serving (VmRSS),
and whether the sidecar had imported torch by then (it should not: no pool needs it yet).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hicache.client.health import SERVING, check_health  # noqa: E402

ECHO = """
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(4))
h = health.HealthServicer()
h.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(h, server)
server.add_insecure_port("unix://" + sys.argv[1])
server.start()
server.wait_for_termination()
"""

PROBE = "import sys; print(sys.modules.get('torch') is not None, flush=True)"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one(cmd: list[str], sock: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (os.path.exists(sock) and check_health(f"unix://{sock}", timeout=1.0) == SERVING):
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:3]} exited {proc.returncode}")
            time.sleep(0.01)
        ready = time.perf_counter() - t0
        time.sleep(0.3)  # idle a moment
        return ready, rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)


def torch_loaded() -> bool:
    """Whether importing the server and building its service imports torch."""
    code = (
        "import sys; import server.app; from server.config import parse_args; "
        "from hicache.sidecar import HiCacheService; "
        "cfg, _ = parse_args(['--socket', '/tmp/never.sock', '--hicache-storage-backend', 'none'], {}); "
        "HiCacheService(cfg.service); " + PROBE
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] == "True"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hcs") as tmp:
        sock = os.path.join(tmp, "s.sock")
        commands = {
            "sidecar": [sys.executable, "-m", "server", "--socket", sock, "--hicache-storage-backend", "none"],
            "echo": [sys.executable, "-c", ECHO, sock],
        }
        for name, cmd in commands.items():
            samples = []
            for _ in range(args.runs):
                if os.path.exists(sock):
                    os.unlink(sock)
                samples.append(one(cmd, sock))
            rows[name] = {
                "ready_s": statistics.median(s[0] for s in samples),
                "rss_mb": statistics.median(s[1] for s in samples),
            }
    rows["sidecar_over_echo_ready"] = rows["sidecar"]["ready_s"] / rows["echo"]["ready_s"]
    rows["sidecar_imports_torch_at_start"] = torch_loaded()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for name in ("sidecar", "echo"):
        print(f"{name:8} SERVING after {rows[name]['ready_s']:.3f} s, {rows[name]['rss_mb']:.0f} MB resident")
    print(
        f"sidecar / echo start-up {rows['sidecar_over_echo_ready']:.2f}; torch at start: {rows['sidecar_imports_torch_at_start']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
