"""Attacks on a running sidecar, as a hostile or careless user would make them (reliability
round 3), each against a real `python -m server` process, with what the sidecar answered.

    python benchmarks/attacks.py            # a table; exit 1 if any attack got through
    python benchmarks/attacks.py --json

1. device memory named by a TCP caller: a plain /dev/shm file, and a name that does not exist;
2. a frozen sidecar: SIGSTOP for 2.5 leases while its engine keeps renewing;
3. an unusable storage folder (a path under a regular file), with and without
   --hicache-storage-optional;
4. host budgets that cannot work: --hicache-size above /dev/shm; a budget of 40% of /dev/shm
   registered with a 5 s deadline, then a second pool; a caller that gives up at 0.2 s;
   one namespace registering pools until refused;
5. absurd model configs: num_hidden_layers 10**12, and malformed JSON;
6. SIGTERM under load: 4 engines offload 35 MiB and reload it layer-wise, 3 times;
7. round 4 (benchmarks/attacks_round4.py): host memory after register/unregister cycles, an
   engine-copy grant slowed past its lease, a member writing onto another's host page, one
   member pinning a whole shared cache, an engine-copy tenant claiming 10**6 device pages,
   and a page planted in the file tier with and without a tier secret.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hicache.client import HiCacheClient, HiCacheRpcError  # noqa: E402
from hicache.geometry import KVGeometry, model_geometries  # noqa: E402
from hicache.memory import MemoryHandle, shm_dir  # noqa: E402
from hicache.pools import DeviceKVPool  # noqa: E402

CONFIG = ROOT / "tests" / "fixtures" / "model_configs" / "mimo_v2_flash.json"
TOKEN = "attack-token"
Outcome = tuple[str, bool]  # what happened, and whether the sidecar held


def geometry() -> KVGeometry:
    with open(CONFIG) as f:
        return model_geometries(json.load(f), tp_size=1, page_size=64, dtype="bfloat16")["full"]


def server_argv(folder: str, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "server", "--socket", os.path.join(folder, "hc.sock"),
        "--model-config", str(CONFIG), "--kv-cache-dtype", "bfloat16", "--log-level", "WARNING", *flags,
    ]  # fmt: skip


@contextmanager
def sidecar(*flags: str) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """A sidecar process (no storage tier unless `flags` name one) and its addresses."""
    folder = tempfile.mkdtemp(prefix="hcatk")
    if "--hicache-storage-backend" not in flags and "--hicache-storage-backend-extra-config" not in flags:
        flags = ("--hicache-storage-backend", "none", *flags)
    proc = subprocess.Popen(server_argv(folder, *flags), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        if "serving on " not in line:
            proc.kill()
            raise RuntimeError(f"the sidecar did not start: {line!r}")
        yield proc, line.split("serving on ", 1)[1].split(";")[0].split()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
        shutil.rmtree(folder, ignore_errors=True)


def start_up(*flags: str, config: Path = CONFIG) -> tuple[int, list[str]]:
    """Exit code and stderr lines of a sidecar that should refuse to start."""
    folder = tempfile.mkdtemp(prefix="hcatk")
    argv = [a if a != str(CONFIG) else str(config) for a in server_argv(folder, *flags)]
    try:
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        return r.returncode, r.stderr.strip().splitlines()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def rpc_code(call: Callable[[], object]) -> str:
    try:
        call()
        return "OK"
    except HiCacheRpcError as exc:
        return exc.code.name


def device_memory_by_name() -> Outcome:
    victim = os.path.join(shm_dir(), f"victim-app-state-{os.getpid()}")
    with open(victim, "wb") as f:
        f.write(b"secret" * 1000)
    g = geometry()
    answers = []
    try:
        with sidecar("--listen", "127.0.0.1:0", "--token", TOKEN) as (_, addresses):
            with HiCacheClient(addresses[1], token=TOKEN, timeout=30) as client:
                for name in (os.path.basename(victim), f"no-such-segment-{os.getpid()}"):
                    try:
                        client.register_memory(g, 1, MemoryHandle("shm", g.page_bytes, name=name))
                        answers.append("ACCEPTED")
                    except HiCacheRpcError as exc:
                        answers.append(f"{exc.code.name}: {exc.details.replace(name, '<name>')}")
    finally:
        os.unlink(victim)
    held = "ACCEPTED" not in answers and answers[0] == answers[1]
    return f"an existing file and a missing one both: {answers[0]}", held


def frozen_sidecar() -> Outcome:
    g = geometry()
    dev = DeviceKVPool(g, 2)
    with sidecar("--lease-timeout", "2") as (proc, addresses), HiCacheClient(addresses[0], timeout=20) as client:
        client.register(dev, model_id="MiMo-V2-Flash")
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(5)
        os.kill(proc.pid, signal.SIGCONT)
        code = rpc_code(lambda: client.lookup(client.page_keys(list(range(64)))))
    dev.close()
    return f"stopped 5 s with a 2 s lease; the engine's next call: {code}", code == "OK"


def unusable_storage() -> Outcome:
    blocker = tempfile.NamedTemporaryFile(prefix="hcatk")
    extra = json.dumps({"dir": os.path.join(blocker.name, "tier")})
    flags = ("--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra)
    rc, err = start_up(*flags)
    dev = DeviceKVPool(geometry(), 2)
    with sidecar(*flags, "--hicache-storage-optional") as (_, addresses):
        with HiCacheClient(addresses[0], timeout=30) as client:
            code = rpc_code(lambda: client.register(dev, model_id="MiMo-V2-Flash"))
            down = code == "OK" and not client.stats()[0].storage_healthy
    dev.close()
    blocker.close()
    held = rc == 2 and len(err) == 1 and code == "OK" and down
    return f"without optional: exit {rc}, {len(err)} line; with it: register {code}, tier reported down {down}", held


def host_budgets() -> list[tuple[str, Outcome]]:
    out = []
    rc, err = start_up("--hicache-size", "1000000000")
    out.append(("--hicache-size 1e9", (f"exit {rc}: {err[-1] if err else ''}", rc == 2 and len(err) == 1)))
    total = shutil.disk_usage(shm_dir()).total
    gb = round(0.4 * total / 1e9, 1)
    g = geometry()
    devs = [DeviceKVPool(g, 4) for _ in range(2)]
    with sidecar("--hicache-size", str(gb), "--admin-token", "adm") as (_, addresses):
        with HiCacheClient(addresses[0], timeout=5, retries=0) as client:
            times, codes = [], []
            for dev in devs:
                t0 = time.perf_counter()
                codes.append(rpc_code(lambda d=dev: client.register(d, model_id="MiMo-V2-Flash")))
                times.append(time.perf_counter() - t0)
        what = f"--hicache-size {gb} ({gb / total * 1e9:.0%} of {shm_dir()}), 5 s deadline"
        outcome = f"{codes[0]} in {times[0]:.2f} s, a second pool {codes[1]} in {times[1]:.2f} s"
        out.append((what, (outcome, codes == ["OK", "OK"])))
    for dev in devs:
        dev.close()
    out.append(("a caller that gives up at 0.2 s", gave_up(gb)))
    out.append(("one namespace, pools until refused", namespace_quota()))
    return out


def gave_up(gb: float) -> Outcome:
    dev = DeviceKVPool(geometry(), 4)
    with sidecar("--hicache-size", str(gb), "--admin-token", "adm") as (_, addresses):
        with HiCacheClient(addresses[0], timeout=0.2, retries=0) as client:
            code = rpc_code(lambda: client.register(dev, model_id="MiMo-V2-Flash"))
        with HiCacheClient(addresses[0], timeout=20, admin_token="adm") as admin:
            deadline = time.monotonic() + 30
            while admin.stats(all_pools=True) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = len(admin.stats(all_pools=True))
    dev.close()
    return f"the caller got {code}; pools left {left}", left == 0


def namespace_quota() -> Outcome:
    g = KVGeometry(**dict(geometry().to_dict(), layer_num=1, layer_ids=[0]))
    devs: list[DeviceKVPool] = []
    with sidecar("--max-pools-per-namespace", "4") as (_, addresses), HiCacheClient(addresses[0], timeout=30) as c:
        refusal = ""
        for _ in range(64):
            devs.append(DeviceKVPool(g, 1))
            try:
                c.register_memory(g, 1, devs[-1].handle, namespace="greedy")
            except HiCacheRpcError as exc:
                refusal = f"{exc.code.name}: {exc.details}"
                break
        other = rpc_code(lambda: c.register_memory(g, 1, devs[-1].handle, namespace="other"))
    for dev in devs:
        dev.close()
    registered = len(devs) - 1
    return f"{registered} pools, then {refusal}; another namespace: {other}", registered == 4 and other == "OK"


def absurd_configs() -> list[tuple[str, Outcome]]:
    folder = Path(tempfile.mkdtemp(prefix="hcatk"))
    huge, broken = folder / "huge.json", folder / "broken.json"
    cfg = json.loads(CONFIG.read_text())
    huge.write_text(json.dumps({**cfg, "num_hidden_layers": 10**12}))
    broken.write_text(CONFIG.read_text()[:200])
    out = []
    for what, path, needle in (("num_hidden_layers 10**12", huge, "num_hidden_layers"), ("malformed JSON", broken, "")):
        rc, err = start_up(config=path)
        last = err[-1] if err else ""
        out.append((what, (f"exit {rc}: {last}", rc == 2 and len(err) == 1 and (needle or path.name) in last)))
    shutil.rmtree(folder, ignore_errors=True)
    return out


def sigterm_under_load(runs: int = 3) -> Outcome:
    codes: Counter[str] = Counter()
    for _ in range(runs):
        with sidecar() as (proc, addresses):
            stop = threading.Event()
            ready = threading.Barrier(5)

            def engine(
                seed: int, address: str = addresses[0], ready: threading.Barrier = ready, stop: threading.Event = stop
            ) -> None:
                g = geometry()
                dev = DeviceKVPool(g, 48)
                with HiCacheClient(address, timeout=60) as client:
                    client.register(dev, model_id="MiMo-V2-Flash")
                    keys = client.page_keys([seed] * (24 * 64))
                    ready.wait()
                    while True:
                        code = rpc_code(lambda: client.offload(keys, list(range(24))))
                        if code == "OK":
                            code = rpc_code(lambda: client.reload(keys, list(range(24, 48)), layerwise=True).wait())
                        codes[code] += 1
                        if stop.is_set() and code != "OK":
                            break
                dev.close()

            threads = [threading.Thread(target=engine, args=(seed,)) for seed in range(4)]
            for t in threads:
                t.start()
            ready.wait(timeout=120)
            time.sleep(2)
            stop.set()
            proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(120)
    held = "CANCELLED" not in codes and set(codes) <= {"OK", "FAILED_PRECONDITION", "UNAVAILABLE"}
    return f"{runs} runs, calls by outcome: {dict(codes)}", held


def main(argv: list[str] | None = None) -> int:
    from attacks_round4 import round4

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results: list[tuple[str, Outcome]] = [
        ("device memory named over TCP", device_memory_by_name()),
        ("sidecar frozen past the lease", frozen_sidecar()),
        ("storage folder unusable", unusable_storage()),
        *host_budgets(),
        *absurd_configs(),
        ("SIGTERM under load", sigterm_under_load()),
        *round4(),
    ]
    if args.json:
        print(json.dumps([{"attack": a, "outcome": o, "held": h} for a, (o, h) in results], indent=2))
    else:
        print("| attack | outcome | held |\n|---|---|---|")
        for attack, (outcome, held) in results:
            print(f"| {attack} | {outcome} | {'yes' if held else '**no**'} |")
    return 0 if all(h for _, (_, h) in results) else 1


if __name__ == "__main__":
    sys.exit(main())
