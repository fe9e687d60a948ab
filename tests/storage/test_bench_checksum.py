"""A smoke run of benchmarks/checksum.py at tiny sizes: it runs and reports every key (no timing checks)."""

import importlib.util
import json
from pathlib import Path

import pytest

from hicache.storage import page_format

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "checksum.py"


@pytest.mark.skipif(page_format._xxh3_long is None, reason="hicache.storage._xxh3 is not built")
def test_checksum_benchmark_reports_every_loop_and_restores_the_loop_in_use(capsys):
    from hicache.storage import _xxh3

    spec = importlib.util.spec_from_file_location("bench_checksum", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    before = _xxh3.set_loop("portable")
    try:
        bench.main(["--page-bytes", "4096", "--pages", "3", "--repeat", "3", "--json"])
        assert _xxh3.set_loop("portable") == "portable"  # the benchmark put back the loop it found
    finally:
        _xxh3.set_loop(before)
    out = json.loads(capsys.readouterr().out)
    for where in ("hot", "cold"):
        assert out[f"xxhash_{where}_GBps"] > 0 and out[f"copy_{where}_GBps"] > 0
        for name in _xxh3.loops():
            for figure in ("GBps", "ratio_to_xxhash", "ratio_to_copy"):
                assert out[f"{name}_{where}_{figure}"] > 0, (name, where, figure)
