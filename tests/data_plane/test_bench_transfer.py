"""A smoke run of benchmarks/transfer.py at tiny sizes: it runs and reports every key (no timing checks)."""

import importlib.util
import json
from pathlib import Path

import pytest

from hicache.transfer import native

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
        and out["layerwise_busy_over_plain_1page"] > 0
        and 0 <= out["layerwise_busy_1page_over_1ms"] <= 1
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


@pytest.mark.skipif(not native.available(), reason="C extension not built")
def test_gil_sweep_smoke():
    """The sweep behind HOLD_GIL_BYTES reports each figure and sets the bound back."""
    bench = load_bench()
    rows = bench.gil_sweep(sizes=(4096, 65536), span=1 << 20, repeat=4)
    assert [r["bytes"] for r in rows] == [4096, 65536]
    for r in rows:
        for name in ("held", "released"):
            assert r[f"{name}_busy_p50_us"] > 0 and r[f"{name}_busy_mean_us"] > 0
            assert 0 <= r[f"{name}_busy_over_1ms"] <= 1
        assert r["alone_us"] > 0
    assert native._native is not None and native._native.hold_gil_bytes() == native.HOLD_GIL_BYTES
    assert "released p50" in bench.sweep_table(rows)
