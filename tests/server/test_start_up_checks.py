"""`hicache-server` refuses at start what it can check at start, naming the flag or the
environment variable, and reads an extra config the way SGLang does (@file, SGLang's keys)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sidecar_util import ROOT

from hicache.memory import cuda_available
from server.config import parse_args


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--page-size", "0"], {}, "--page-size must be >= 1"),
        (["--workers", "1"], {}, "--workers must be an int >= 2, got 1"),
        ([], {"HICACHE_RATIO": "abc"}, "HICACHE_RATIO='abc': --hicache-ratio takes a float"),
        ([], {"HICACHE_MEM_LAYOUT": "sideways"}, "HICACHE_MEM_LAYOUT='sideways': --hicache-mem-layout takes one of"),
        (["--hicache-storage-backend-extra-config", '{"nope": 1}'], {}, "accepted: ['dir', 'max_bytes', 'fsync'"),
        (["--hicache-storage-backend-extra-config", "@/nowhere/x.json"], {}, "@/nowhere/x.json: No such file"),
    ],
)
def test_bad_start_up_values_are_refused_naming_them(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_args(["--socket", "/tmp/never.sock", *argv], environ=env)
    assert message in str(exc.value), str(exc.value)


def test_workers_come_from_the_flag_or_its_variable_and_set_the_event_stream_limit() -> None:
    config, _ = parse_args(["--socket", "/tmp/never.sock", "--workers", "32"], environ={})
    assert (config.workers, config.max_event_streams, config.max_streams) == (32, 16, 24)
    config, _ = parse_args(["--socket", "/tmp/never.sock"], environ={"HICACHE_WORKERS": "6"})
    assert (config.workers, config.max_event_streams, config.max_streams) == (6, 3, 5)


@pytest.mark.skipif(cuda_available(), reason="this host has CUDA: the kernel backend is valid here")
def test_the_kernel_io_backend_needs_cuda_unless_interpreted() -> None:
    with pytest.raises(ValueError, match="kernel runs Triton copy kernels on CUDA"):
        parse_args(["--socket", "/tmp/never.sock", "--hicache-io-backend", "kernel"], environ={})
    config, _ = parse_args(
        ["--socket", "/tmp/never.sock", "--hicache-io-backend", "kernel"], environ={"TRITON_INTERPRET": "1"}
    )
    assert config.service.io_backend == "kernel"


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_an_sglang_extra_config_file_works_unchanged(tmp_path: Path, suffix: str) -> None:
    extra = {"dir": str(tmp_path / "tier"), "prefetch_threshold": 256, "prefetch_timeout_base": 2.0}
    extra["prefetch_timeout_per_ki_token"] = 0.5
    path = tmp_path / f"extra{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(extra))
    else:
        path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in extra.items()))
    config, _ = parse_args(["--socket", "/tmp/never.sock", "--hicache-storage-backend-extra-config", f"@{path}"], {})
    h = config.service.hierarchy
    assert set(h.storage_extra) == {"dir", "max_bytes"}  # the backend sees its own keys only (and its cap)
    assert (h.prefetch_timeout.base_s, h.prefetch_timeout.per_ki_token_s) == (2.0, 0.5)


def test_the_server_command_prints_one_line_and_exits_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server", "--socket", "/tmp/never.sock"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HICACHE_RATIO": "abc"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "hicache-server: error: HICACHE_RATIO='abc': --hicache-ratio takes a float"


def test_the_default_file_tier_is_capped_at_a_share_of_the_free_disk(tmp_path: Path) -> None:
    import shutil as sh

    from hicache.storage.factory import DEFAULT_FILE_MAX, default_file_cap

    folder = tmp_path / "not-yet" / "tier"  # measured on the disk it will be on
    extra = json.dumps({"dir": str(folder)})
    config, _ = parse_args(["--socket", "/tmp/never.sock", "--hicache-storage-backend-extra-config", extra], {})
    cap = config.service.hierarchy.extra_config["max_bytes"]
    free = sh.disk_usage(tmp_path).free
    assert cap == default_file_cap(folder) and 0 < cap <= min(DEFAULT_FILE_MAX, free // 10 + 4096)
    mine = json.dumps({"dir": str(folder), "max_bytes": 12345})
    config, _ = parse_args(["--socket", "/tmp/never.sock", "--hicache-storage-backend-extra-config", mine], {})
    assert config.service.hierarchy.extra_config["max_bytes"] == 12345  # a cap the operator set is kept


def test_stats_show_each_tiers_capacity(tmp_path: Path) -> None:
    from sidecar_util import filled_device

    from hicache.api import Tier
    from hicache.client import HiCacheClient
    from server import create_server

    extra = json.dumps({"dir": str(tmp_path / "tier"), "max_bytes": 10_000_000})
    config, _ = parse_args(
        [
            "--socket",
            str(tmp_path / "hc.sock"),
            "--hicache-storage-backend-extra-config",
            extra,
            "--hicache-ratio",
            "1",
        ],
        {},
    )
    srv, address = create_server(config)
    dev = filled_device(4)
    try:
        with HiCacheClient(address) as client:
            client.register(dev, model_id="m@1")
            host, storage = client.stats()[0].tiers
            assert (host.tier, host.capacity_bytes) == (Tier.HOST, 4 * dev.geometry.page_bytes)
            assert (storage.tier, storage.capacity_bytes) == (Tier.STORAGE, 10_000_000)
    finally:
        srv.stop(0)
        dev.close()


def test_with_json_logs_every_line_is_json_and_the_banner_names_the_bound_metrics_port(tmp_path: Path) -> None:
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--socket", str(tmp_path / "hc.sock"), "--log-format", "json"]
        + ["--metrics-port", "0", "--hicache-storage-backend-extra-config", json.dumps({"dir": str(tmp_path / "t")})],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "serving on" in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    records = [json.loads(x) for x in [*lines, *rest.splitlines()] if x.strip()]  # each line is one object
    banner = next(r for r in records if r["msg"].startswith("serving on"))
    port = int(banner["metrics"].rsplit(":", 1)[1].split("/")[0])
    assert port > 0 and banner["metrics"] == f"http://127.0.0.1:{port}/metrics"
    assert any("file tier under" in r["msg"] and "bytes of pages per model" in r["msg"] for r in records)


def test_a_cluster_flag_that_disagrees_with_the_server_is_one_line_at_start(tmp_path: Path, redis_cluster) -> None:  # type: ignore[no-untyped-def]
    from tier_helpers import RedisServer

    plain = RedisServer(tmp_path)
    plain.start()
    try:
        cases = [
            ("redis-cluster", plain.url.removesuffix("/0"), "is not a cluster node (cluster_enabled:0)"),
            ("redis", redis_cluster.url, "is a Redis Cluster node (cluster_enabled:1)"),
        ]
        for backend, url, message in cases:
            out = subprocess.run(
                [
                    sys.executable, "-m", "server", "--socket", str(tmp_path / "never.sock"),
                    "--hicache-storage-backend", backend,
                    "--hicache-storage-backend-extra-config", json.dumps({"url": url}),
                ],
                cwd=ROOT, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert out.returncode == 2, out.stderr
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and message in lines[0] and lines[0].startswith("hicache-server: error:"), lines
    finally:
        plain.stop()


@pytest.mark.parametrize(
    ("argv", "env", "flag"),
    [
        (["--lease-timeout", "nan"], {}, "--lease-timeout"),
        (["--lease-timeout", "inf"], {}, "--lease-timeout"),
        ([], {"HICACHE_LEASE_TIMEOUT": "nan"}, "--lease-timeout"),
        (["--grace", "nan"], {}, "--grace"),
        (["--health-interval", "nan"], {}, "--health-interval"),
        (["--health-interval", "inf"], {}, "--health-interval"),
        (["--hicache-ratio", "nan"], {}, "--hicache-ratio"),
        (["--hicache-size", "inf"], {}, "--hicache-size"),
        (["--hicache-storage-backend-extra-config", '{"prefetch_timeout_max_s": NaN}'], {}, "prefetch_timeout_max_s"),
    ],
)
def test_non_finite_seconds_and_sizes_are_refused_at_start_naming_the_flag(
    argv: list[str], env: dict[str, str], flag: str
) -> None:
    with pytest.raises(ValueError) as exc:  # before: accepted, and every RegisterPool leaked a pool
        parse_args(["--socket", "/tmp/never.sock", *argv], environ=env)
    message = str(exc.value)
    assert flag in message and ("nan" in message or "inf" in message) and "\n" not in message, message


def test_start_up_errors_follow_the_log_format_and_name_the_variable_they_came_from(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.app import main

    assert main(["--socket", "/tmp/never.sock", "--log-format", "json", "--lease-timeout", "0"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)  # before: plain text, whatever --log-format said
    assert record["level"] == "ERROR" and "--lease-timeout" in record["msg"]
    for argv, named in ((["--bogus"], "unrecognized arguments: --bogus"), (["--workers", "many"], "--workers")):
        assert main(["--socket", "/tmp/never.sock", "--log-format", "json", *argv]) == 2
        (line,) = capsys.readouterr().err.splitlines()  # before: argparse's usage text, not JSON
        assert named in json.loads(line)["msg"] and "hicache-server --help" in json.loads(line)["msg"]
    monkeypatch.setenv("HICACHE_LOG_FORMAT", "json")
    monkeypatch.setenv("HICACHE_LOG_LEVEL", "LOUD")
    assert main(["--socket", "/tmp/never.sock"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "HICACHE_LOG_LEVEL" in json.loads(line)["msg"]  # before: named --log-level, never typed


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["--tp-size", "0"], "--tp-size", "0"),
        (["--kv-cache-dtype", "bogus"], "--kv-cache-dtype", "'bogus'"),
        (["--socket", ""], "--socket", "''"),
    ],
)
def test_engine_shape_flags_and_the_socket_are_checked_without_a_model_config(
    argv: list[str], flag: str, value: str
) -> None:
    """Without --model-config these flags size nothing, but a bad value is still refused, not
    ignored until the day a model config is added (and an empty socket is not the default)."""
    with pytest.raises(ValueError) as exc:
        parse_args(["--socket", "/tmp/never.sock", *argv], environ={})
    message = str(exc.value)
    assert flag in message and value in message and "\n" not in message, message


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"num_hidden_layers": 1000000000000, "num_attention_heads": 8, "hidden_size": 512}',
            "num_hidden_layers must be <= 16384, got 1000000000000",
        ),
        (
            '{"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512, "head_dim": 99999999}',
            "head_dim must be <= 1048576",
        ),
        (
            '{"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512, "num_key_value_heads": 1e30}',
            "num_key_value_heads must be an int",
        ),
        ('{"num_hidden_layers": 4,', "is not valid JSON"),
        ("[1, 2]", "is not a JSON object"),
    ],
    ids=["layers", "head_dim", "heads_float", "malformed", "not_an_object"],
)
def test_an_absurd_or_malformed_model_config_is_one_line_naming_the_field_or_file(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    out = subprocess.run(
        [sys.executable, "-m", "server", "--socket", str(tmp_path / "hc.sock"), "--model-config", str(path)],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    if "JSON" in message:
        assert str(path) in lines[0]
