"""`hicache health` and `hicache stats` against an in-process sidecar."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from sidecar_util import filled_device, mimo_geometries

from hicache.cli import main
from hicache.client import HiCacheClient
from hicache.sidecar.config import ServiceConfig
from hicache.transfer import native
from server import ServerConfig, create_server


def test_health_and_stats_commands(capsys):
    d = tempfile.mkdtemp(prefix="hc")
    sock = os.path.join(d, "hc.sock")
    srv, address = create_server(
        ServerConfig(socket=sock, admin_token="adm", service=ServiceConfig(expected=mimo_geometries()))
    )
    try:
        assert main(["health", "--socket", sock]) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        assert main(["stats", "--socket", sock]) == 1  # every pool's ids and namespaces: admins only
        assert "PERMISSION_DENIED: stats of all pools: missing admin token" in capsys.readouterr().err
        assert main(["stats", "--socket", sock, "--admin-token", "adm"]) == 0
        assert capsys.readouterr().out.strip() == "no pools registered"
        dev = filled_device(4)
        with HiCacheClient(address) as client:
            info = client.register(dev, namespace="tenant-a")
            client.offload(client.page_keys(list(range(32))), [0, 1])
            os.environ["HICACHE_ADMIN_TOKEN"] = "adm"
            try:
                assert main(["stats", "--target", address, "--json"]) == 0
            finally:
                del os.environ["HICACHE_ADMIN_TOKEN"]
            report = json.loads(capsys.readouterr().out)
            (pool,) = report["pools"]
            assert pool["pool_id"] == info.pool_id and pool["used_pages"] == 2 and pool["namespace"] == "tenant-a"
            assert pool["tiers"]["host"]["pages"] == 2
            assert pool["copy_backend"] == ("native" if native.available() else "torch")
            assert pool["write_policy"] == "write_through"  # the server's default --hicache-write-policy
            assert main(["stats", "--target", address, "--admin-token", "adm"]) == 0
            table = capsys.readouterr().out
            assert info.pool_id in table and "2/8" in table
        dev.close()
    finally:
        srv.stop(0)
        shutil.rmtree(d, ignore_errors=True)
    assert main(["health", "--socket", sock, "--timeout", "0.5"]) == 2  # no connection, as grpc_health_probe
    assert capsys.readouterr().out.strip() in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_health_exits_as_grpc_health_probe_does(capsys, tmp_path):
    import time

    from hicache.cache.config import HiCacheConfig
    from hicache.cli import health_exit_code

    dead_redis = HiCacheConfig(storage_backend="redis", extra_config={"url": "redis://127.0.0.1:1", "timeout_s": 0.2})
    sock = str(tmp_path / "hc.sock")
    srv, address = create_server(
        ServerConfig(socket=sock, health_interval_s=0.1, service=ServiceConfig(hierarchy=dead_redis))
    )
    dev = filled_device(2)
    try:
        with HiCacheClient(address) as client:
            client.register(dev, model_id="m@1")  # its storage tier (Redis) is unreachable
            for _ in range(200):
                if main(["health", "--socket", sock]) == 4:
                    break
                time.sleep(0.05)
            assert main(["health", "--socket", sock]) == 4
            assert capsys.readouterr().out.strip().splitlines()[-1] == "NOT_SERVING"
    finally:
        srv.stop(0)
        dev.close()
    assert [health_exit_code(s) for s in ("SERVING", "UNAVAILABLE", "NOT_SERVING", "NOT_FOUND")] == [0, 2, 4, 3]


def test_an_unreachable_redis_is_not_serving_from_the_start(capsys, tmp_path):
    from hicache.cache.config import HiCacheConfig

    dead = HiCacheConfig(storage_backend="redis", extra_config={"url": "redis://127.0.0.1:1", "timeout_s": 0.2})
    sock = str(tmp_path / "hc.sock")
    srv, _ = create_server(ServerConfig(socket=sock, service=ServiceConfig(hierarchy=dead)))
    try:  # no pool has registered yet: the configured backend itself is probed
        assert main(["health", "--socket", sock]) == 4
        assert capsys.readouterr().out.strip() == "NOT_SERVING"
    finally:
        srv.stop(0)
    sock2 = str(tmp_path / "ok.sock")
    srv, _ = create_server(ServerConfig(socket=sock2, storage_optional=True, service=ServiceConfig(hierarchy=dead)))
    try:  # an optional tier only degrades the sidecar
        assert main(["health", "--socket", sock2]) == 0
    finally:
        srv.stop(0)


def test_health_tells_a_failed_call_from_an_unknown_status_and_dials_a_relative_socket(capsys, tmp_path, monkeypatch):
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health_pb2_grpc

    class Broken(health_pb2_grpc.HealthServicer):
        def Check(self, request, context):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")  # the call fails with gRPC's UNKNOWN code

    broken = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(Broken(), broken)
    port = broken.add_insecure_port("127.0.0.1:0")
    broken.start()
    try:
        assert main(["health", "--target", f"127.0.0.1:{port}", "--timeout", "30"]) == 3  # before: 4, NOT_SERVING's
    finally:
        broken.stop(0)
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a timeout must be a finite number of seconds
        main(["health", "--target", f"127.0.0.1:{port}", "--timeout", "nan"])
    assert "--timeout: must be a finite number of seconds > 0, got 'nan'" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    srv, _ = create_server(ServerConfig(socket="rel.sock"))
    try:
        assert main(["health", "--socket", "rel.sock", "--timeout", "30"]) == 0  # before: dialled as a DNS name
        assert capsys.readouterr().out.strip() == "SERVING"
    finally:
        srv.stop(0)
