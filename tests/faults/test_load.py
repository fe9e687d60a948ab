"""A short run of benchmarks/load.py against an in-process sidecar: 8 engines, a few hundred
mixed operations, every page read back exact, no errors (no timing checks)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hicache.cache.config import HiCacheConfig
from hicache.sidecar.config import ServiceConfig
from server import ServerConfig, create_server

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "load.py"


def load_bench():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("bench_load", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_load_run_is_exact_with_no_errors():
    bench = load_bench()
    folder = tempfile.mkdtemp(prefix="hc")
    tier = HiCacheConfig(storage_backend="file", extra_config={"dir": os.path.join(folder, "tier")}, ratio=0.5)
    srv, address = create_server(
        ServerConfig(socket=os.path.join(folder, "hc.sock"), service=ServiceConfig(hierarchy=tier))
    )
    try:
        report = bench.run_load(
            address, clients=8, ops=400, seconds=120, device_pages=24, sources=16, page_size=4, layers=2
        )
        srv.service.check_integrity()
    finally:
        srv.stop(0)
        shutil.rmtree(folder, ignore_errors=True)
    assert report["errors"] == {} and report["mismatches"] == []
    assert report["operations"] == 400 and report["pages_checked"] > 0 and report["exact_fraction"] == 1.0
    assert report["final_pages_exact"] + report["final_pages_missing"] == 8 * 16
    assert report["final_acknowledged_missing"] == 0  # the file tier kept every acknowledged page
    assert report["ok"]
    statuses = report["statuses"]
    assert statuses.get("STORED", 0) > 0 and statuses.get("LOADED", 0) + statuses.get("LOADED_FROM_STORAGE", 0) > 0


def test_main_reports_json(capsys):
    import json

    bench = load_bench()
    assert (
        bench.main(
            [
                "--clients",
                "2",
                "--ops",
                "60",
                "--device-pages",
                "8",
                "--sources",
                "4",
                "--page-size",
                "4",
                "--layers",
                "1",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] and out["operations"] == 60 and set(out["latency_all"]) == {"n", "p50_ms", "p99_ms", "p999_ms"}


def test_short_chaos_run_serves_no_damaged_page_and_only_the_hostile_engine_errs(capsys):  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("bench_chaos", BENCH.parent / "chaos.py")
    assert spec is not None and spec.loader is not None
    chaos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chaos)
    rc = chaos.main(["--clients", "3", "--ops", "600", "--faults", "24", "--fault-every", "0.02", "--json"])
    report = __import__("json").loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, report
    assert report["mismatches"] == [] and report["honest_errors"] == {} and report["sidecar_alive"]
    assert report["hostile_engine"] == {"FAILED_PRECONDITION": 20}
    assert sum(report["faults_injected"].values()) > 0
