"""Quotas inside a shared host cache (#46 point 4): one member cannot pin the whole cache."""

from __future__ import annotations

import shutil
import tempfile
import uuid

import pytest
from sidecar_util import MODEL, filled_device, keys_for, mimo_geometries
from sidecar_util import start_in_process as start

from hicache.api import KeyStatus, PoolInfo
from hicache.cache.config import HiCacheConfig
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.errors import QuotaExceeded
from hicache.sidecar.service import HiCacheService

S = KeyStatus


def test_a_member_pins_at_most_its_share_and_the_others_keep_room() -> None:
    hierarchy = HiCacheConfig(ratio=2.0)  # 16 host pages over 8-page device pools
    svc = HiCacheService(ServiceConfig(expected=mimo_geometries(), hierarchy=hierarchy, max_pin_share=0.5))
    a, b = filled_device(8, seed=1), filled_device(8, seed=2)
    try:
        ia, ib = (
            svc.register(uuid.uuid4().hex, geometry=d.geometry, device_pages=8, device_memory=d.handle, model_id=MODEL)
            for d in (a, b)
        )
        assert isinstance(ia, PoolInfo) and isinstance(ib, PoolInfo) and svc.stats(ia.pool_id)[0].host_pages == 16
        ks = keys_for(16, seed=3)
        assert svc.offload("o1", ia.pool_id, ks[:8], list(range(8))).statuses == (S.STORED,) * 8
        assert svc.unregister("u", ib.pool_id)  # alone in its cache, a pool may pin all of it
        assert svc.pin("p0", ia.pool_id, ks[:8]) == (S.PINNED,) * 8
        assert svc.unpin("u0", ia.pool_id, ks[:8]) == (S.UNPINNED,) * 8
        ib = svc.register(uuid.uuid4().hex, geometry=b.geometry, device_pages=8, device_memory=b.handle, model_id=MODEL)
        assert isinstance(ib, PoolInfo)
        assert svc.offload("o2", ia.pool_id, ks[8:], list(range(8))).statuses == (S.STORED,) * 8
        assert svc.pin("p1", ia.pool_id, ks[:6]) == (S.PINNED,) * 6
        with pytest.raises(
            QuotaExceeded, match=r"would pin 9 pages; one pool may pin 8 of .* 16 \(--max-pin-share 0.5\)"
        ):
            svc.pin("p2", ia.pool_id, ks[4:9])  # 2 of them pinned already, 3 new: 9 in all
        assert svc.stats(ia.pool_id)[0].pinned_pages == 6  # nothing changed
        assert svc.pin("p3", ia.pool_id, [*ks[6:8], keys_for(1, seed=99)[0]]) == (S.PINNED,) * 2 + (S.NOT_FOUND,)
        # the other member still finds room: a's unpinned pages are evicted for it
        mine = keys_for(8, seed=4)
        assert svc.offload("o3", ib.pool_id, mine, list(range(8))).statuses == (S.STORED,) * 8
        assert svc.pin("p4", ib.pool_id, mine) == (S.PINNED,) * 8  # its own share
        svc.check_integrity()
    finally:
        svc.close()
        a.close()
        b.close()


def test_the_refusal_is_resource_exhausted_over_grpc_and_the_flag_is_checked() -> None:
    with pytest.raises(ValueError, match=r"--max-pin-share must be in \(0, 1\], got 0"):
        ServiceConfig(max_pin_share=0)
    sockdir = tempfile.mkdtemp(prefix="hc")
    srv, address = start(sockdir, max_pin_share=0.25, hierarchy=HiCacheConfig(ratio=1.0))
    dev, other = filled_device(8, seed=5), filled_device(8, seed=7)
    try:
        with HiCacheClient(address, timeout=30) as client, HiCacheClient(address, timeout=30) as neighbour:
            neighbour.register(other, model_id=MODEL)  # the cache is shared
            client.register(dev, model_id=MODEL)
            ks = keys_for(8, seed=6)
            assert client.offload(ks, list(range(8))).statuses == (S.STORED,) * 8
            assert client.pin(ks[:2]) == (S.PINNED,) * 2
            with pytest.raises(HiCacheRpcError, match=r"RESOURCE_EXHAUSTED: .*--max-pin-share 0.25"):
                client.pin(ks[2:3])
    finally:
        srv.stop(0)
        dev.close()
        other.close()
        shutil.rmtree(sockdir, ignore_errors=True)
