"""The Mooncake master lost, restarted empty, or down at start-up: misses and refused writes,
never a hang or a wrong page; health and stats say so; service resumes on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

from helpers import eventually
from sidecar_util import CONFIG_PATH, PAGE_SIZE, ROOT
from tier_helpers import GEOMETRIES, identity, key, payload

from hicache.demo.loopback_ports import free_ports
from hicache.demo.mooncake_local import LocalMooncakeMaster
from hicache.storage.factory import backend_reachable
from hicache.storage.mooncake_link import close_links


def stored_again(tier, k: bytes, data: bytes) -> bool:
    return tier.set(k, data) and tier.get(k) is not None


def test_master_lost_mid_run_then_restarted_empty(mooncake, master: LocalMooncakeMaster):
    g = GEOMETRIES["mimo_kv"]
    tier = mooncake(identity(g), backoff_initial_s=0.05, backoff_max_s=0.5)
    assert tier.batch_set([(key(i), payload(g, i)) for i in range(3)]) == [True] * 3
    master.stop()
    # gone: reads miss, writes are refused, nothing raises; health and stats say why
    eventually(lambda: tier.get(key(0)) is None, what="a read missing with the master gone")
    assert tier.batch_set([(key(5), payload(g, 5))]) == [False]
    assert tier.batch_contains([key(0), key(1)]) == [False, False] and tier.batch_exists([key(0)]) == 0
    health = tier.health()
    assert not health.healthy and master.address in health.detail
    stats = tier.stats()
    assert not stats.healthy and stats.nodes_down == [master.address] and stats.errors >= 1
    assert stats.write_failures >= 1 and master.address in stats.last_error
    master.start()  # same address, no objects: misses, then normal service
    eventually(lambda: tier.health().healthy, what="the tier healthy after the master restarted")
    assert tier.get(key(0)) is None and tier.batch_exists([key(0), key(1)]) == 0
    eventually(lambda: stored_again(tier, key(0), payload(g, 0)), what="a write after the restart")
    assert bytes(tier.get(key(0))) == payload(g, 0) and tier.stats().nodes_down == []


def test_master_down_at_start_then_up(tmp_path):
    """A tier made while the master is down does not wait for it (Mooncake's set-up would,
    for about 90 s): it is unhealthy, and connects once the master answers."""
    from hicache.storage.mooncake import MooncakeTier

    master = LocalMooncakeMaster(tmp_path)
    g = GEOMETRIES["deepseek_mla"]
    tier = MooncakeTier(identity(g), master.extra_config(backoff_initial_s=0.05, backoff_max_s=0.2))
    try:
        health = tier.health()
        assert not health.healthy and "unreachable" in health.detail and master.address in health.detail
        assert not tier.set(key(1), payload(g, 1)) and tier.get(key(1)) is None
        assert backend_reachable("mooncake", master.extra_config()) == (
            False,
            health.detail.split(";")[0],
        )
        master.start()
        eventually(lambda: tier.health().healthy, what="the tier connected once the master answered")
        eventually(lambda: stored_again(tier, key(1), payload(g, 1)), what="a write once connected")
        assert backend_reachable("mooncake", master.extra_config()) == (True, "")
    finally:
        tier.close()
        close_links(master.address)
        master.stop()


def sidecar_args(sockdir: str, extra: dict[str, object], *more: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "server",
        "--socket",
        os.path.join(sockdir, "hc.sock"),
        "--model-config",
        str(CONFIG_PATH),
        "--page-size",
        str(PAGE_SIZE),
        "--hicache-storage-backend",
        "mooncake",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
        *more,
    ]


def test_start_up_stops_in_one_line_when_the_master_does_not_answer(tmp_path):
    (port,) = free_ports(1, bus=False)
    extra = {"master_server_address": f"127.0.0.1:{port}"}
    out = subprocess.run(sidecar_args(str(tmp_path), extra), cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "unreachable" in lines[0] and "--hicache-storage-optional" in lines[0]


def storage_healthy_metric(port: int) -> float:
    """hicache_storage_healthy{backend="mooncake"} from the sidecar's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        body = reply.read().decode()
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "hicache_storage_healthy" and sample.labels.get("backend") == "mooncake":
                return sample.value
    raise AssertionError("no hicache_storage_healthy sample for the mooncake backend")


def test_start_up_with_optional_storage_serves_then_connects(tmp_path):
    from sidecar_util import filled_device, keys_for, mimo_geometries

    from hicache.api import KeyStatus, Tier
    from hicache.cache.config import HiCacheConfig
    from hicache.client import HiCacheClient
    from hicache.sidecar.config import ServiceConfig
    from server import ServerConfig, create_server

    master = LocalMooncakeMaster(tmp_path)
    extra = master.extra_config(backoff_initial_s=0.05, backoff_max_s=0.2)
    hierarchy = HiCacheConfig(storage_backend="mooncake", extra_config=extra, ratio=2.0)
    service = ServiceConfig(expected=mimo_geometries(), hierarchy=hierarchy, storage_optional=True)
    config = ServerConfig(socket=str(tmp_path / "hc.sock"), service=service, metrics_port=0, metrics_host="127.0.0.1")
    srv, address = create_server(config)
    dev = filled_device(4)
    try:
        with HiCacheClient(address, timeout=20) as client:
            info = client.register(dev, model_id="m@1")
            keys = keys_for(2)
            assert client.offload(keys, [0, 1]).statuses == (KeyStatus.STORED,) * 2  # host memory serves
            assert client.lookup(keys).tiers == (Tier.HOST,) * 2
            (stats,) = client.stats(info)
            assert stats.storage_backend == "mooncake" and not stats.storage_healthy
            assert stats.storage_nodes_down == (master.address,)
            assert storage_healthy_metric(srv.metrics_port) == 0.0
            master.start()
            eventually(lambda: client.stats(info)[0].storage_healthy, what="storage healthy once the master is up")
            assert client.stats(info)[0].storage_nodes_down == ()
            assert storage_healthy_metric(srv.metrics_port) == 1.0
    finally:
        srv.stop(0)
        dev.close()
        close_links(master.address)
        master.stop()
