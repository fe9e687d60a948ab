"""Merge the GPU check's results into one JSON (stdout): the tests' summary line, each
layout's transfer figures with the 0.9-of-pinned-memcpy goal, and the IPC round trip.

    python scripts/gpu_check_report.py WORK_DIR TESTS_LOG
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GOAL = 0.9  # of the pinned cudaMemcpy peak, host -> device and device -> host


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        err = path.with_suffix(".err")
        tail = err.read_text()[-2000:] if err.exists() else ""
        return {"error": f"{type(exc).__name__}: {exc}", "stderr": tail}


def main(work: str, tests_log: str) -> int:
    folder = Path(work)
    lines = Path(tests_log).read_text().splitlines() if Path(tests_log).exists() else []
    report: dict[str, Any] = {"tests": lines[-1] if lines else "no test output"}
    transfers = {}
    for path in sorted(folder.glob("transfer-*.json")):
        r = read_json(path)
        layout = path.stem.removeprefix("transfer-")
        if "offload_ratio" in r:
            r["goal_met"] = r["offload_ratio"] >= GOAL and r["reload_ratio"] >= GOAL
        transfers[layout] = r
    report["transfer"] = transfers
    report["ipc"] = read_json(folder / "ipc.json")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
