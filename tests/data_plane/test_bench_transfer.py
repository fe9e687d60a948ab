"""A smoke run of benchmarks/transfer.py at tiny sizes: it runs and reports every key (no timing checks)."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "transfer.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_transfer", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_benchmark_smoke_json(layout, capsys):
    bench = load_bench()
    args = ["--pages", "3", "--page-size", "2", "--repeat", "1", "--layout", layout, "--json"]
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("offload_gbps", "reload_gbps", "memcpy_gbps", "offload_ratio", "reload_ratio", "naive_ratio"):
        assert out[key] > 0, key
    for key in ("page1_offload_ratio", "page1_reload_ratio", "page1_offload_us", "page1_offload_one_thread_ratio"):
        assert out[key] > 0, key
    assert (
        out["layerwise_over_plain"] > 0
        and out["layerwise_over_plain_1page"] > 0
        and out["layerwise_busy_over_plain"] > 0
    )
    assert "page16_offload_ratio" not in out  # a transfer of 3 pages has no 16-page figure
    assert out["layout"] == layout and out["pages"] == 3 and out["page_size"] == 2 and out["device"] == "cpu"
    assert out["geometry"]["v_head_dim"] == 128 and out["geometry"]["layer_num"] == 9


def test_benchmark_table_and_bad_flags(capsys):
    bench = load_bench()
    assert bench.main(["--pages", "2", "--page-size", "1", "--repeat", "1", "--dtype", "fp8", "--no-naive"]) == 0
    text = capsys.readouterr().out
    assert "memcpy device->host" in text and "reload (engine)" in text
    assert bench.main(["--pages", "2", "--dtype", "int3"]) == 2
    assert "unknown KV dtype 'int3'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--pages", "0"])
