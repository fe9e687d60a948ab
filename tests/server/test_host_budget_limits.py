"""Host budgets that cannot work (round 3, point 4): a --hicache-size above what /dev/shm
holds is refused at start-up; a registration answers before its pool's host memory is all
reserved, and one whose caller gave up keeps nothing; one namespace cannot take every slot."""

from __future__ import annotations

import os
import threading

import grpc
import pytest
from sidecar_util import MODEL, filled_device, mimo_geometries

from hicache.api import PoolInfo
from hicache.cache.config import HiCacheConfig
from hicache.client import HiCacheClient
from hicache.client.handles import HiCacheRpcError
from hicache.memory import shm_dir
from hicache.pools import DeviceKVPool
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.errors import NoSpace
from hicache.sidecar.host_growth import FIRST_BYTES, first_pages
from hicache.sidecar.service import HiCacheService
from server import ServerConfig, create_server, main, parse_args
from server.config import host_budget_problem


def test_a_host_budget_above_what_dev_shm_holds_is_refused_at_start_up(capsys):
    assert main(["--hicache-size", "1000000000", "--socket", "/nonexistent/hc.sock"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--hicache-size 1e+09 GB is more than" in err[0] and f"{shm_dir()} can hold (" in err[0]
    assert host_budget_problem(0.5) == ""  # what fits starts
    assert parse_args(["--hicache-size", "1000000000"], {})[0].service.hierarchy.size_gb == 1e9  # flags stay valid


def register(svc: HiCacheService, dev: DeviceKVPool, rid: str, namespace: str = "") -> PoolInfo | NoSpace:
    return svc.register(
        rid,
        geometry=dev.geometry,
        device_pages=dev.num_pages,
        device_memory=dev.handle,
        model_id=MODEL,
        namespace=namespace,
    )


def allocated_bytes(shm_name: str) -> int:
    return os.stat(os.path.join(shm_dir(), shm_name)).st_blocks * 512


def test_a_registration_reserves_its_first_pages_and_the_pool_grows_to_its_share_in_the_background():
    svc = HiCacheService(ServiceConfig(hierarchy=HiCacheConfig(storage_backend="none", size_gb=0.4)))
    dev = filled_device(8)
    try:
        info = register(svc, dev, "r")
        assert isinstance(info, PoolInfo)
        first = first_pages(info.host_pages, dev.geometry.page_bytes)
        assert first < info.host_pages  # the segment is sized for the whole share
        (pool,) = svc.pool_snapshots()
        assert pool.shared.host_goal == info.host_pages and pool.host_pages >= first
        assert svc.host_growth.settle(timeout=120)
        assert svc.stats(info.pool_id)[0].host_pages == info.host_pages
        assert allocated_bytes(info.host_shm_name) >= info.host_nbytes - FIRST_BYTES // 4  # reserved by now
        svc.check_integrity()
    finally:
        svc.close()
        dev.close()


def test_a_namespace_holds_at_most_its_quota_of_pools_and_the_refusal_names_it():
    svc = HiCacheService(ServiceConfig(hierarchy=HiCacheConfig(storage_backend="none"), max_pools_per_namespace=2))
    devs = [filled_device(4, seed=i) for i in range(4)]
    try:
        assert all(isinstance(register(svc, d, f"r{i}", "tenant-a"), PoolInfo) for i, d in enumerate(devs[:2]))
        out = register(svc, devs[2], "r2", "tenant-a")
        assert isinstance(out, NoSpace)
        assert "namespace 'tenant-a' holds 2 pools" in out.reason and "--max-pools-per-namespace" in out.reason
        assert len(svc.pool_ids) == 2  # nothing half-made
        assert isinstance(register(svc, devs[3], "r3", "tenant-b"), PoolInfo)  # another namespace still may
    finally:
        svc.close()
        for d in devs:
            d.close()
    with pytest.raises(ValueError, match="max_pools_per_namespace must be >= 1, got 0"):
        ServiceConfig(max_pools_per_namespace=0)
    config, _ = parse_args(["--max-pools", "8", "--max-pools-per-namespace", "3"], {})
    assert config.service.max_pools == 8 and config.service.max_pools_per_namespace == 3


def segments() -> set[str]:
    """This process's shared-memory segments (the in-process sidecar's among them)."""
    return {n for n in os.listdir(shm_dir()) if n.startswith("hicache-") and f"-{os.getpid()}-" in n}


def test_a_registration_whose_caller_gave_up_keeps_nothing(tmp_path):
    config = ServerConfig(
        socket=str(tmp_path / "hc.sock"), admin_token="adm", service=ServiceConfig(expected=mimo_geometries())
    )
    srv, address = create_server(config)
    dev = filled_device(4)
    space = srv.service._space_lock  # held here, the registration outlives its caller's deadline
    released = threading.Event()
    srv.service.add_release_hook(lambda pool: released.set())
    try:
        with HiCacheClient(address, timeout=1.0, retries=0, admin_token="adm") as client:
            before = segments()
            space.acquire()
            try:
                with pytest.raises(HiCacheRpcError) as exc:
                    client.register(dev, model_id="mimo@test")
                assert exc.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            finally:
                space.release()
            assert released.wait(timeout=60)  # it finished, found its caller gone and let go
            with HiCacheClient(address, timeout=20, admin_token="adm") as admin:
                assert admin.stats(all_pools=True) == [] and srv.service.pool_ids == []
            assert segments() == before  # its host pool and progress block unlinked
    finally:
        srv.stop(0)
        dev.close()
