"""A two-process CUDA IPC round trip through the sidecar (run by scripts/gpu_check.sh on the
GPU machine): this process is the engine with its KV pool in CUDA memory; the sidecar, in
its own process, opens it by CUDA IPC, offloads pages to its pinned host pool and reloads
them layer by layer. Every reloaded page is compared with the original; the figures go to
one JSON file. Two checks of the interprocess events, where a missing wait shows as wrong
bytes:
- offload without a synchronize: the engine's stream sleeps, then rewrites the pages, and
  offload() is called at once; the sidecar's copy must wait for the engine's event;
- layer-wise reload with GPU waits: wait_layer only orders this process's stream, and the
  pages are read back on that stream with no host wait for the reload first.

    python scripts/gpu_ipc_check.py OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hicache import DeviceKVPool, KVGeometry, page_keys  # noqa: E402
from hicache.client import HiCacheClient  # noqa: E402
from hicache.client.health import SERVING, check_health  # noqa: E402

SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU time before the pages are rewritten


def start_sidecar(sock: str) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [sys.executable, "-m", "server", "--socket", sock, "--hicache-storage-backend", "none"]
        + ["--page-size", "64", "--hicache-ratio", "2", "--log-level", "WARNING"],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 120
    while not (os.path.exists(sock) and check_health(f"unix://{sock}", timeout=1) == SERVING):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the sidecar did not come up")
        time.sleep(0.2)
    return server


def pages_equal(dev: DeviceKVPool, first: int, want: list[torch.Tensor]) -> bool:
    return all(torch.equal(dev.read_page(first + p), w) for p, w in enumerate(want))


def main(out_path: str) -> int:
    g = KVGeometry(layer_num=9, head_num=4, head_dim=192, v_head_dim=128, page_size=64)  # MiMo-V2-Flash full
    pages = 64
    result: dict[str, object] = {"pages": pages, "page_bytes": g.page_bytes}
    with tempfile.TemporaryDirectory(prefix="hcg") as tmp:
        sock = os.path.join(tmp, "hc.sock")
        server = start_sidecar(sock)
        try:
            dev = DeviceKVPool(g, 3 * pages, "cuda")
            dev.flat.copy_(torch.randint(0, 256, (dev.nbytes,), dtype=torch.uint8, device="cuda"))
            # pages, not flat bytes: the device pool is layer-first, so a page is spread over it
            want = [dev.read_page(p).clone() for p in range(pages)]
            with HiCacheClient(f"unix://{sock}", timeout=120) as client:
                client.register(dev, model_id="gpu-check")
                keys = page_keys(list(range(pages * 64)), 64)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r = client.offload(keys, list(range(pages)))
                offload_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                h = client.reload(keys, list(range(pages, 2 * pages)), layerwise=True)
                for layer in range(g.layer_num):
                    h.wait_layer(layer)
                h.wait()
                torch.cuda.synchronize()
                reload_s = time.perf_counter() - t0
                nbytes = pages * g.page_bytes
                result.update(
                    stored=sum(s.name == "STORED" for s in r.statuses),
                    reload_statuses=sorted({s.name for s in h.statuses}),
                    bit_exact=pages_equal(dev, pages, want),
                    offload_gbps=nbytes / offload_s / 1e9,
                    layerwise_reload_gbps=nbytes / reload_s / 1e9,
                    stats=[s.copy_backend for s in client.stats()],
                )
                result.update(event_checks(client, dev, g, pages))
            dev.close()
        finally:
            server.terminate()
            server.wait(60)
    Path(out_path).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    ok = all(result.get(k) for k in ("bit_exact", "offload_waits_for_the_engine", "reload_gpu_waits_exact"))
    return 0 if ok else 1


def event_checks(client: HiCacheClient, dev: DeviceKVPool, g: KVGeometry, pages: int) -> dict[str, object]:
    """The two interprocess-event checks (module docstring)."""
    first = 2 * pages  # pages rewritten after a GPU sleep, offloaded at once
    fresh = torch.randint(0, 256, (pages, g.page_bytes), dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    for p in range(pages):
        dev.write_page(first + p, fresh[p])
    keys = page_keys(list(range(10**6, 10**6 + pages * 64)), 64)
    t0 = time.perf_counter()
    client.offload(keys, list(range(first, first + pages)))  # no synchronize before it
    offload_call_s = time.perf_counter() - t0
    want = [fresh[p].cpu() for p in range(pages)]  # read_page hands back host tensors
    torch.cuda.synchronize()
    # reload into pages 0.. and read them back on this stream with GPU waits only
    dev.flat.zero_()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    h = client.reload(keys, list(range(pages)), layerwise=True)
    for layer in range(g.layer_num):
        h.wait_layer(layer)
    waits_s = time.perf_counter() - t0
    got = [dev.read_page(p).clone() for p in range(pages)]  # queued behind the GPU waits
    h.wait()
    torch.cuda.synchronize()
    settled = [dev.read_page(p) for p in range(pages)]  # after the host saw the reload end
    offload_ok = all(torch.equal(a, b) for a, b in zip(settled, want, strict=True))
    waits_ok = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    return {
        "offload_waits_for_the_engine": offload_ok,  # stale pages would differ from `fresh`
        "reload_gpu_waits": h.gpu_waits,
        "reload_gpu_waits_exact": waits_ok and h.gpu_waits,
        "offload_call_ms": offload_call_s * 1e3,
        "layerwise_reload_call_and_waits_ms": waits_s * 1e3,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-ipc.json"))
