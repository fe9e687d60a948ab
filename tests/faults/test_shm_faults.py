"""Shared memory that runs out or changes under the sidecar: a /dev/shm that holds one host
pool while two engines register at once (Docker's default 64 MiB shm), run in a private
mount namespace with a small tmpfs on /dev/shm."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RACE = textwrap.dedent(
    """
    import shutil, sys, threading
    sys.path[:0] = [{root!r}, {tests!r}]
    from sidecar_util import mimo_full
    from hicache.api import PoolInfo
    from hicache.cache.config import HiCacheConfig
    from hicache.pools import DeviceKVPool
    from hicache.sidecar.errors import NoSpace
    from hicache.sidecar.config import ServiceConfig
    from hicache.sidecar.service import HiCacheService

    g = mimo_full()
    svc = HiCacheService(ServiceConfig(hierarchy=HiCacheConfig(ratio=8.0)))
    devices = [DeviceKVPool(g, 2) for _ in range(2)]
    print("free before", shutil.disk_usage("/dev/shm").free, flush=True)
    results, start = [None, None], threading.Barrier(2)

    def register(i):
        start.wait()
        results[i] = svc.register(f"r{{i}}", geometry=g, device_pages=2, device_memory=devices[i].handle,
                                  model_id="m", group="full")

    threads = [threading.Thread(target=register, args=(i,)) for i in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    kinds = sorted(type(r).__name__ for r in results)
    print("results", kinds, [str(r) for r in results if isinstance(r, NoSpace)], flush=True)
    assert kinds == ["NoSpace", "PoolInfo"], kinds
    svc.check_integrity()
    svc.close()
    print("ok", flush=True)
    """
)


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare to mount a private /dev/shm")
def test_two_registrations_on_a_shm_that_holds_one_host_pool_refuse_one_and_never_sigbus(tmp_path: Path) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from sidecar_util import mimo_full

    g = mimo_full()
    device, host = g.pool_bytes(2), g.pool_bytes(16)
    size = (2 * device + host + host // 2) // 4096 * 4096  # both device pools, one and a half host pools
    script = tmp_path / "race.py"
    script.write_text(RACE.format(root=str(ROOT), tests=str(ROOT / "tests")))
    cmd = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} {script}"
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])  # -7 would be SIGBUS
    assert out.stdout.splitlines()[-1] == "ok", out.stdout
    assert re.search(r"needs \d+ bytes, /dev/shm has \d+ free|does not fit in /dev/shm", out.stdout), out.stdout
