"""A storage folder that cannot hold pages (read-only, or not a folder): with
--hicache-storage-optional pools register and host memory serves while health and stats say
the tier is down; without it, start-up refuses in one line naming the folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_util import CONFIG_PATH, PAGE_SIZE, filled_device, keys_for, start_in_process

from hicache.api import KeyStatus, Tier
from hicache.cache.config import HiCacheConfig
from hicache.client import HiCacheClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    subprocess.run(["umount", os.path.join(d, "ro")], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


def unusable_folders(sockdir: str) -> list[str]:
    """A path under a regular file (on every machine) and, where this process may mount, a
    folder on a read-only tmpfs."""
    plain = os.path.join(sockdir, "plain-file")
    Path(plain).write_text("not a folder")
    folders = [os.path.join(plain, "tier")]
    ro = os.path.join(sockdir, "ro")
    os.mkdir(ro)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", ro], capture_output=True).returncode == 0:
        folders.append(os.path.join(ro, "tier"))
    return folders


def test_without_optional_storage_start_up_refuses_in_one_line_naming_the_folder(sockdir: str) -> None:
    for folder in unusable_folders(sockdir):
        out = subprocess.run(
            [sys.executable, "-m", "server", "--socket", os.path.join(sockdir, "hc.sock")]
            + ["--model-config", str(CONFIG_PATH), "--page-size", str(PAGE_SIZE)]
            + ["--hicache-storage-backend-extra-config", json.dumps({"dir": folder})],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr
        assert folder in lines[0] and "cannot hold pages" in lines[0]


def test_with_optional_storage_pools_register_and_host_memory_serves(sockdir: str) -> None:
    for i, folder in enumerate(unusable_folders(sockdir)):
        hierarchy = HiCacheConfig(storage_backend="file", extra_config={"dir": folder}, ratio=2.0)
        srv, address = start_in_process(os.path.join(sockdir), hierarchy=hierarchy, storage_optional=True)
        dev = filled_device(4, seed=i)
        try:
            with HiCacheClient(address, timeout=20) as client:
                info = client.register(dev, model_id="m@1")
                keys = keys_for(2, seed=i)
                assert client.offload(keys, [0, 1]).statuses == (KeyStatus.STORED,) * 2
                assert client.lookup(keys).tiers == (Tier.HOST,) * 2
                (stats,) = client.stats(info)
                assert stats.storage_backend == "file" and not stats.storage_healthy
                ok, why = srv.service.healthy()  # what the gRPC health service reports
                assert not ok and "could not be made" in why
            assert not srv.service.healthy()[0]  # with no pool left, the folder itself is checked
        finally:
            srv.stop(0)
            dev.close()
