"""Host memory goes back to /dev/shm when a pool leaves, without the garbage collector.

Each test runs in a private mount namespace whose /dev/shm is a tmpfs of twice one
registration's memory (device pool plus host pool), so a pool whose memory stayed behind
makes the next registration fail. The first runs a real hicache-server (engines register and
unregister over gRPC, then one dies and its lease expires); the second runs the service in a
process with the garbage collector off, with host growth stepping in small steps."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from test_shm_faults import _can_unshare, run_in_small_shm

ROOT = Path(__file__).resolve().parents[2]
PAGES = 4  # device pages per engine; the host pool is RATIO times that

SERVER_CYCLES = textwrap.dedent(
    """
    import os, shutil, subprocess, sys, tempfile, time
    sys.path[:0] = [{root!r}, {tests!r}]
    from sidecar_util import filled_device, keys_for, start_sidecar
    from hicache.api import KeyStatus
    from hicache.client import HiCacheClient

    def shm_used():
        return shutil.disk_usage("/dev/shm").used

    sockdir = tempfile.mkdtemp()
    proc, address = start_sidecar(sockdir, "--hicache-ratio", "{ratio}", "--hicache-storage-backend", "none",
                                  "--lease-timeout", "1")
    try:
        while not os.path.exists(os.path.join(sockdir, "hc.sock")):  # the sidecar is up
            assert proc.poll() is None
            time.sleep(0.05)
        baseline = shm_used()
        for cycle in range({cycles}):
            client = HiCacheClient(address, timeout=60)
            device = filled_device({pages}, seed=cycle)
            client.register(device, model_id="m")
            keys = keys_for(2, seed=cycle)
            assert client.offload(keys, [0, 1]).statuses == (KeyStatus.STORED,) * 2
            assert client.reload(keys, [2, 3]).statuses == (KeyStatus.LOADED,) * 2
            client.close()
            device.close()
            t0 = time.monotonic()
            while shm_used() > baseline and time.monotonic() - t0 < 1.0:
                time.sleep(0.01)
            assert shm_used() <= baseline, ("cycle", cycle, "shm used", shm_used(), "before any pool", baseline)
        # an engine that dies without unregistering: its lease expires and its host pool goes
        child = subprocess.run([sys.executable, "-c", {dying!r}, address], capture_output=True, text=True)
        assert child.returncode == 0, child.stderr
        t0 = time.monotonic()
        while shm_used() > baseline and time.monotonic() - t0 < 5.0:
            time.sleep(0.05)
        assert shm_used() <= baseline, ("after a dead engine's lease", shm_used(), baseline)
        assert proc.poll() is None
    finally:
        proc.terminate()
        print(proc.communicate(timeout=60)[0].decode()[-2000:])
    print("ok", flush=True)
    """
)

# registers, then exits at once without unregistering (its device segment is unlinked at exit)
DYING = textwrap.dedent(
    """
    import os, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from sidecar_util import filled_device
    from hicache.client import HiCacheClient
    client = HiCacheClient(sys.argv[1], timeout=60)
    client.register(filled_device({pages}), model_id="m")
    """
)

SERVICE_CYCLES = textwrap.dedent(
    """
    import gc, shutil, sys, time
    gc.disable()
    sys.path[:0] = [{root!r}, {tests!r}]
    from sidecar_util import mimo_full
    import hicache.sidecar.host_growth as growth
    from hicache.api import PoolInfo
    from hicache.cache.config import HiCacheConfig
    from hicache.pools import DeviceKVPool
    from hicache.sidecar.config import ServiceConfig
    from hicache.sidecar.service import HiCacheService

    g = mimo_full()
    growth.FIRST_BYTES = growth.STEP_BYTES = g.page_bytes  # one page first, then a page per step
    svc = HiCacheService(ServiceConfig(hierarchy=HiCacheConfig(ratio={ratio}, storage_backend="none")))
    device = DeviceKVPool(g, {pages})
    free0 = shutil.disk_usage("/dev/shm").free
    for cycle in range({cycles}):
        info = svc.register("r", geometry=g, device_pages={pages}, device_memory=device.handle, model_id="m")
        assert isinstance(info, PoolInfo), (cycle, str(info))
        if cycle % 2:
            svc.host_growth.settle(30)  # grown whole on odd cycles, released mid-growth on even ones
        assert svc.unregister("u", info.pool_id), cycle
        assert shutil.disk_usage("/dev/shm").free >= free0, (cycle, shutil.disk_usage("/dev/shm").free, free0)
    svc.close()
    print("ok", flush=True)
    """
)


def _run_in_small_shm(tmp_path: Path, script: str, shm_bytes: int) -> str:
    path = tmp_path / "cycles.py"
    path.write_text(script)
    return run_in_small_shm(path, shm_bytes, timeout=540)


def _shm_bytes(ratio: int) -> int:
    sys.path[:0] = [str(ROOT / "tests")]
    from sidecar_util import mimo_full

    one = mimo_full().pool_bytes(PAGES) * (1 + ratio)  # the engine's device pool and its host pool
    return (2 * one + 4095) // 4096 * 4096


needs_unshare = pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare to mount a private /dev/shm")


@needs_unshare
def test_100_register_unregister_cycles_through_a_real_sidecar_on_a_shm_twice_one_pool(tmp_path: Path) -> None:
    fmt = {"root": str(ROOT), "tests": str(ROOT / "tests"), "pages": PAGES}
    dying = DYING.format(**fmt)
    script = SERVER_CYCLES.format(**fmt, ratio=8, cycles=100, dying=dying)
    _run_in_small_shm(tmp_path, script, _shm_bytes(8))


@needs_unshare
def test_100_cycles_with_host_growth_and_the_garbage_collector_off(tmp_path: Path) -> None:
    fmt = {"root": str(ROOT), "tests": str(ROOT / "tests"), "pages": PAGES}
    script = SERVICE_CYCLES.format(**fmt, ratio=8, cycles=100)
    _run_in_small_shm(tmp_path, script, _shm_bytes(8))
