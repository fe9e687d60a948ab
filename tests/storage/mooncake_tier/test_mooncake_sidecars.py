"""Two sidecar processes on one Mooncake cluster: pages one engine offloads through its
sidecar are found and reloaded bit-exact by another engine through the other sidecar; a
tenant of another namespace does not see them."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch
from helpers import eventually
from sidecar_util import filled_device, keys_for, start_sidecar

from hicache.api import KeyStatus, Tier
from hicache.client import HiCacheClient
from hicache.demo.mooncake_local import LocalMooncakeMaster


@pytest.fixture
def two_sidecars(master: LocalMooncakeMaster) -> Iterator[tuple[str, str]]:
    extra = json.dumps(master.extra_config())
    dirs = [tempfile.mkdtemp(prefix="hc") for _ in range(2)]
    started = [
        start_sidecar(d, "--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", extra)
        for d in dirs
    ]
    yield started[0][1], started[1][1]
    for proc, _ in started:
        proc.terminate()
        proc.wait(timeout=60)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def test_pages_offloaded_through_one_sidecar_reload_through_another(two_sidecars):
    address_a, address_b = two_sidecars
    dev_a, dev_b, dev_c = filled_device(8, seed=1), filled_device(8, seed=2), filled_device(8, seed=3)
    keys = keys_for(4, seed=11)
    with (
        HiCacheClient(address_a, timeout=60) as a,
        HiCacheClient(address_b, timeout=60) as b,
        HiCacheClient(address_b, timeout=60) as c,
    ):
        a.register(dev_a, model_id="m@1", namespace="tenant")
        info_b = b.register(dev_b, model_id="m@1", namespace="tenant")
        c.register(dev_c, model_id="m@1", namespace="other")
        assert a.offload(keys, [0, 1, 2, 3]).statuses == (KeyStatus.STORED,) * 4
        eventually(lambda: b.lookup(keys).tiers == (Tier.STORAGE,) * 4, what="B seeing A's pages in Mooncake")
        assert c.lookup(keys).tiers == (Tier.NONE,) * 4  # another namespace: other objects
        assert b.reload(keys, [4, 5, 6, 7]).statuses == (KeyStatus.LOADED_FROM_STORAGE,) * 4
        assert all(torch.equal(dev_a.read_page(p), dev_b.read_page(4 + p)) for p in range(4))
        (stats,) = b.stats(info_b)
        assert stats.storage_backend == "mooncake" and stats.storage_healthy and stats.tiers[1].hits == 4
    for dev in (dev_a, dev_b, dev_c):
        dev.close()
