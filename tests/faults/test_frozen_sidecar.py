"""A lease measures the engine's silence, not the sidecar's: a sidecar stopped (SIGSTOP) for
longer than the lease, while its engine kept renewing, keeps the engine's pool when it runs
again; an engine that really went quiet still loses its pool after the lease."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator

import pytest
from helpers import eventually
from sidecar_util import filled_device, keys_for, start_sidecar

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient, HiCacheRpcError


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_stopped_sidecar_keeps_the_pools_its_engines_kept_renewing(sockdir: str) -> None:
    proc, address = start_sidecar(sockdir, "--lease-timeout", "2", "--hicache-storage-backend", "none")
    dev = filled_device(4)
    try:
        with HiCacheClient(address, timeout=20) as client:
            client.register(dev)
            keys = keys_for(2)
            assert client.offload(keys, [0, 1]).statuses == (KeyStatus.STORED,) * 2
            os.kill(proc.pid, signal.SIGSTOP)  # 2.5 leases, while the client's renewals queue up
            time.sleep(5)
            os.kill(proc.pid, signal.SIGCONT)
            assert client.lookup(keys).tiers == (Tier.HOST,) * 2  # its pool is still there
            time.sleep(3)  # and stays while renewed
            assert client.lookup(keys).tiers == (Tier.HOST,) * 2
            # an engine that stops renewing still loses its pool after the lease
            quiet = HiCacheClient(address, timeout=20)
            other = filled_device(4, seed=1)
            pool = quiet.register(other)
            quiet._conn.stop_keep_alive()
            with HiCacheClient(address, timeout=20) as witness:
                witness.attach(pool.pool_id, pool.secret)

                def gone() -> bool:
                    try:
                        witness.lookup(keys, pool=pool.pool_id)  # renews it while it lives: asked every 3 s
                    except HiCacheRpcError as exc:
                        return exc.code.name == "NOT_FOUND"
                    time.sleep(3)
                    return False

                eventually(gone, 30, "the quiet engine's pool released with its lease")
            quiet._conn.close()
            other.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(30)
        dev.close()
