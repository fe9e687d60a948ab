"""make gpu-check DRY_RUN=1: the GPU check script parses and names only files that exist, and
it never installs a torch (the GPU machine's own is used)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def dry_run(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable}
    return subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True)


def test_the_dry_run_finds_every_step_and_file() -> None:
    done = dry_run(ROOT)
    assert done.returncode == 0, done.stderr
    assert "every file present" in done.stdout and "3 layouts" in done.stdout


def test_the_dry_run_fails_naming_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "gpu_check.sh")
    done = dry_run(tmp_path)
    assert done.returncode == 1 and "setup.py is missing" in done.stderr


def test_it_installs_only_the_carried_wheels_and_never_a_torch() -> None:
    text = SCRIPT.read_text()
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs and all("--no-index" in line and "$WHEELS" in line for line in installs)
    assert "torch" not in " ".join(installs)
    make = subprocess.run(["make", "-n", "gpu-check", "DRY_RUN=1"], cwd=ROOT, capture_output=True, text=True)
    assert make.returncode == 0 and "scripts/gpu_check.sh" in make.stdout
