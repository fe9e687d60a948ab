"""A CPU-only sidecar starts without torch: importing the server, the client and hicache, and
building the service, import no torch; the first pool does (its memory is torch tensors)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

START = """
import sys
import hicache, hicache.client, server.app
from server.config import parse_args
from hicache.sidecar import HiCacheService
config, _ = parse_args(["--socket", "/tmp/never.sock", "--hicache-storage-backend", "none"], {})
service = HiCacheService(config.service)
assert service.healthy() == (True, "")
print("torch" in sys.modules)
from hicache import DeviceKVPool  # a pool needs it: now it loads
print("torch" in sys.modules)
"""


def test_the_sidecar_and_the_client_start_without_torch() -> None:
    out = subprocess.run([sys.executable, "-c", START], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
