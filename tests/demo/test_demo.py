"""`hicache demo`: the two-process run end to end (reduced sizes), and its engine catching
a corrupted host page."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from hicache.cli import main
from hicache.client import HiCacheClient
from hicache.demo import load_config, model_geometries, truncate_layers
from hicache.demo.engine import DemoEngine
from hicache.demo.model import ToyModel
from hicache.demo.report import Tally
from hicache.pools import DeviceKVPool
from hicache.sidecar.config import ServiceConfig
from server import HiCacheServer, ServerConfig, create_server

SMALL = ["--layers", "6", "--conversations", "3", "--turns", "3", "--system-tokens", "32", "--turn-tokens", "20,40"]
SMALL += ["--hicache-ratio", "1"]  # a host pool smaller than the chats: pages spill to the file tier


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_demo_serves_a_chat_from_every_tier_and_verifies_everything(sockdir, capsys):
    report = os.path.join(sockdir, "report.json")
    assert main(["demo", *SMALL, "--report-json", report]) == 0
    out = capsys.readouterr().out
    assert "result: all checks passed" in out and "RPC Reload p50 / p99" in out
    r = json.loads(open(report).read())
    assert r["failures"] == []
    assert (
        r["requests"] == 9
        and r["tokens"] == r["device_tokens"] + r["host_tokens"] + r["storage_tokens"] + r["computed_tokens"]
    )
    assert r["device_tokens"] > 0 and r["host_tokens"] > 0  # the shared prompt, and earlier turns
    assert r["storage_tokens"] > 0 and r["pages_prefetched"] > 0  # evicted from host, fetched back
    assert r["pages_reloaded"] > 0 and r["pages_verified"] == r["pages_reloaded"] and r["page_mismatches"] == 0
    assert r["attention_checked"] == 9 * 6 and r["attention_mismatches"] == 0
    assert r["device_evictions"] > 0  # more KV than the device pool holds


def test_two_nodes_over_a_redis_cluster_share_prefixes(sockdir, capsys):
    report = os.path.join(sockdir, "report.json")
    args = ["demo", *SMALL, "--nodes", "2", "--hicache-storage-backend", "redis-cluster", "--report-json", report]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "result: all checks passed" in out and "on 2 nodes" in out and "of which another node's" in out
    r = json.loads(open(report).read())
    assert r["nodes"] == 2 and r["failures"] == []
    # every later turn runs on the other node: its prefix comes from storage, computed by the first
    assert r["cross_node_tokens"] > 0 and r["cross_node_tokens"] <= r["storage_tokens"]
    assert r["pages_verified"] == r["pages_reloaded"] and r["recompute_mismatches"] == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "2"], "needs a storage backend the nodes share (redis or redis-cluster), got 'file'"),
        (["--nodes", "0"], "--nodes must be an int >= 1, got 0"),
        (["--nodes", "2", "--sidecar", "/tmp/a.sock"], "needs 2 comma-separated --sidecar targets"),
    ],
)
def test_bad_node_flags_are_one_line_errors(flags, message, capsys):
    assert main(["demo", *SMALL, *flags]) == 2
    assert message in capsys.readouterr().err


def mimo_small() -> dict:
    return truncate_layers(load_config(None), 6)


@pytest.fixture
def served(sockdir: str) -> Iterator[tuple[HiCacheServer, str]]:
    geometries = model_geometries(mimo_small(), tp_size=1, page_size=16, dtype="bfloat16")
    svc = ServiceConfig(expected=geometries)  # host memory only
    srv, address = create_server(ServerConfig(socket=os.path.join(sockdir, "hc.sock"), service=svc))
    yield srv, address
    srv.stop(0)


def test_engine_catches_a_corrupted_host_page(served):
    srv, address = served
    torch.set_num_threads(1)
    geometries = model_geometries(mimo_small(), tp_size=1, page_size=16, dtype="bfloat16")
    model = ToyModel(geometries, window=128)
    pools = {n: DeviceKVPool(g, 8) for n, g in geometries.items()}
    tally = Tally()
    client = HiCacheClient(address, timeout=60)
    pool_ids = {n: client.register(p, group=n, namespace="t").pool_id for n, p in pools.items()}
    engine = DemoEngine(client, pools, pool_ids, model, tally, max_request_pages=6)
    tokens = np.arange(85, dtype=np.int64)  # 5 full pages and 5 tokens
    engine.serve(tokens)
    assert tally.failures() == [] and "no page was reloaded" in tally.notices()[0]  # nothing to check yet
    assert tally.pages_offloaded == 5 * 2 and tally.computed_tokens == 85

    engine.cache = type(engine.cache)(8)  # the engine forgets its device cache: it must reload
    engine.serve(tokens)
    assert tally.host_tokens == 80 and tally.page_mismatches == 0 and tally.failures() == [] == tally.notices()

    host = srv.service.pool(pool_ids["swa"]).host
    host.flat.bitwise_not_()  # every host page of the swa group is now wrong
    engine.cache = type(engine.cache)(8)
    engine.serve(tokens)
    assert tally.page_mismatches == 5  # the 5 swa pages; the full group's pages are intact
    assert any("reloaded pages differ" in f for f in tally.failures())
    engine.close()
    client.close()
    for p in pools.values():
        p.close()
