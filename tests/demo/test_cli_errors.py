"""User errors of the `hicache` command end in one line on stderr and exit 2 (130 for
Ctrl-C), never in a traceback: bad sidecar flags (the sidecar's own message), a sidecar that
is down (named, within seconds), a wrong token, a geometry mismatch."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sidecar_util import CONFIG_PATH, ROOT, start_sidecar

import hicache.demo.run as demo_run
from hicache.cli import main


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--hicache-write-policy", "bogus"], "unknown write policy 'bogus'"),
        (["--hicache-mem-layout", "bogus"], "bogus"),
        (["--hicache-storage-prefetch-policy", "never"], "never"),
        (["--hicache-storage-backend-extra-config", '{"nope": 1}'], "nope"),
        (["--hicache-storage-backend", "redis"], "url"),
    ],
)
def test_a_bad_sidecar_flag_prints_the_sidecars_own_message(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["demo", *flags]) == 2
    line = one_error_line(capsys)
    assert line.startswith("hicache: error: the sidecar did not start: ") and message in line, line
    assert "flush of closed file" not in line


def test_a_sidecar_that_is_down_is_named_within_seconds(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    sock = str(tmp_path / "nobody.sock")
    started = time.monotonic()
    assert main(["demo", "--sidecar", sock]) == 2
    assert time.monotonic() - started < 30
    line = one_error_line(capsys)
    assert line == f"hicache: error: no sidecar serving at {sock}: UNAVAILABLE"


@pytest.fixture
def token_sidecar() -> Iterator[str]:
    d = __import__("tempfile").mkdtemp(prefix="hc")
    proc, target = start_sidecar(
        d, "--token", "s3cret", config=ROOT / "tests" / "fixtures" / "model_configs" / "qwen3_8b.json"
    )
    deadline = time.monotonic() + 60
    from hicache.client.health import check_health

    while check_health(target) != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.05)
    yield target
    proc.terminate()
    proc.wait(timeout=60)
    __import__("shutil").rmtree(d, ignore_errors=True)


def test_a_wrong_token_and_a_geometry_mismatch_are_one_line(
    capsys: pytest.CaptureFixture[str], token_sidecar: str
) -> None:
    assert main(["demo", "--sidecar", token_sidecar, "--token", "guess"]) == 2
    assert one_error_line(capsys).startswith("hicache: error: the sidecar said UNAUTHENTICATED: wrong token")
    # the demo's model is MiMo-V2-Flash; this sidecar expects Qwen3-8B's geometry
    assert main(["demo", "--sidecar", token_sidecar, "--token", "s3cret", "--config", str(CONFIG_PATH)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("hicache: error: the sidecar said INVALID_ARGUMENT: ") and "differs" in line, line


def test_ctrl_c_exits_130_with_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_run, "run_demo", interrupted)
    assert main(["demo"]) == 130
    assert one_error_line(capsys) == "hicache: interrupted"


def test_a_valid_small_workload_is_a_notice_not_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--conversations", "2", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "result: nothing to check: no page was reloaded" in out
