"""Packaging: one version everywhere, both commands answer --version and show defaults in
--help (never a secret), and the wheel ships the licence and the typing marker."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import hicache

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from hicache.cli import main; sys.exit(main())", *args[1:]]
        if args[0] == "hicache"
        else [sys.executable, "-m", "server", *args[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    )
    return out.stdout


def test_one_version_for_the_package_and_both_commands() -> None:
    assert hicache.__version__ == metadata.version("hicache")
    assert run("hicache", "--version").strip() == f"hicache {hicache.__version__}"
    assert run("hicache-server", "--version").strip() == f"hicache-server {hicache.__version__}"


def test_help_shows_defaults_but_never_the_token() -> None:
    server = " ".join(run("hicache-server", "--help", HICACHE_TOKEN="s3cret-value").split())
    assert "--lease-timeout LEASE_TIMEOUT" in server and "(default: 30.0)" in server
    assert "s3cret-value" not in server
    stats = " ".join(run("hicache", "stats", "--help", HICACHE_TOKEN="s3cret-value").split())
    assert "(default: 5.0)" in stats and "s3cret-value" not in stats
    assert "(default: 64)" in " ".join(run("hicache", "geometry", "--help").split())


def test_wheel_ships_license_and_py_typed(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("hicache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hicache/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Version: {hicache.__version__}" in meta and "License-Expression: Apache-2.0" in meta
