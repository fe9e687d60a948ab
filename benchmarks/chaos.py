"""Chaos: the load of benchmarks/load.py while faults are injected from outside, every page
read back verified.

    python benchmarks/chaos.py                 # 6 engines, 6,000 operations, 120 faults
    python benchmarks/chaos.py --json

While N engines run the mixed workload against one sidecar process (file tier), a fault
thread damages page files in the tier folder, one every --fault-every seconds: a file
replaced by a 1 TiB sparse file, a FIFO or a symlink; truncated; a byte flipped; another
key's page copied over it. Before the load, a hostile engine registers, shrinks its own
shared-memory segment to 0 bytes and makes 20 calls on it. The run passes (exit 0) when no engine was ever
served a wrong page, the honest engines saw no error, the hostile one saw only
FAILED_PRECONDITION, and the sidecar is still up. Damaged pages are legitimately gone, so
acknowledged pages that no tier holds at the end are reported, not counted as failures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import geometry, run_load, start_sidecar  # noqa: E402

from hicache.client import HiCacheClient, HiCacheRpcError  # noqa: E402
from hicache.memory import shm_dir  # noqa: E402
from hicache.pools import DeviceKVPool  # noqa: E402

FAULTS = ("sparse_1tib", "fifo", "symlink", "truncated", "flipped", "foreign")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--ops", type=int, default=6000)
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--faults", type=int, default=120, help="tier files damaged during the run")
    p.add_argument("--fault-every", type=float, default=0.05, help="seconds between faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def damage(path: Path, kind: str, other: Path | None, spare: Path) -> None:
    """Apply fault `kind` to the page file `path` (which may vanish meanwhile: OSError)."""
    if kind == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    elif kind == "flipped":
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x20]))
    elif kind == "foreign" and other is not None:
        shutil.copyfile(other, path)
    else:
        path.unlink()
        if kind == "sparse_1tib":
            with open(path, "wb") as f:
                f.truncate(1 << 40)
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            os.symlink(spare, path)


def inject(tier: Path, n: int, every: float, rng: random.Random, stop: threading.Event, done: Counter[str]) -> None:
    spare = tier.parent / "spare.page"
    spare.write_bytes(b"\0" * 4096)
    while sum(done.values()) < n and not stop.is_set():
        time.sleep(every)
        files = [f for f in tier.rglob("*.page") if f.is_file() and not f.is_symlink()]
        if len(files) < 2:
            continue
        path, other = rng.sample(files, 2)
        kind = rng.choice(FAULTS)
        try:
            damage(path, kind, other, spare)
        except OSError:
            continue  # evicted or rewritten meanwhile
        done[kind] += 1


def hostile_engine(address: str, calls: int) -> Counter[str]:
    """Register, shrink the device segment under the sidecar, and keep calling."""
    g = geometry(4, 2)
    dev = DeviceKVPool(g, 8)
    seen: Counter[str] = Counter()
    with HiCacheClient(address, timeout=30) as client:
        client.register(dev, model_id="load/model@1", namespace="hostile")
        os.truncate(os.path.join(shm_dir(), dev.handle.name), 0)
        keys = client.page_keys(list(range(4 * g.page_size)))
        for i in range(calls):
            try:
                if i % 2:
                    client.offload(keys, [0, 1, 2, 3])
                else:
                    client.reload(keys, [4, 5, 6, 7])
                seen["OK"] += 1
            except HiCacheRpcError as exc:
                seen[exc.code.name] += 1
    dev.close()
    return seen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = tempfile.mkdtemp(prefix="hcchaos")
    proc, address = start_sidecar(folder, "file", 0.5)
    stop, done = threading.Event(), Counter[str]()
    rng = random.Random(args.seed)
    tier = Path(folder, "tier")
    fault_thread = threading.Thread(target=inject, args=(tier, args.faults, args.fault_every, rng, stop, done))
    try:
        hostile = hostile_engine(address, 20)
        fault_thread.start()
        report = run_load(
            address, clients=args.clients, ops=args.ops, seconds=args.seconds, seed=args.seed, durable=False
        )
        stop.set()
        fault_thread.join()
        alive = proc.poll() is None
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    out: dict[str, Any] = {
        "engines": args.clients,
        "operations": report["operations"],
        "seconds": report["seconds"],
        "faults_injected": dict(done),
        "pages_checked": report["pages_checked"],
        "mismatches": report["mismatches"],
        "honest_errors": report["errors"],
        "hostile_engine": dict(hostile),
        "acknowledged_missing_at_end": report["final_acknowledged_missing"],
        "sidecar_alive": alive,
    }
    out["ok"] = report["ok"] and alive and set(hostile) == {"FAILED_PRECONDITION"} and sum(done.values()) > 0
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:30} {v}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
