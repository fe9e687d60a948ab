"""A two-process CUDA IPC round trip through the sidecar (run by scripts/gpu_check.sh on the
GPU machine): this process is the engine with its KV pool in CUDA memory; the sidecar, in
its own process, opens it by CUDA IPC, offloads pages to its pinned host pool and reloads
them layer by layer. Every reloaded page is compared with the original; the figures go to
one JSON file.

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


def main(out_path: str) -> int:
    g = KVGeometry(layer_num=9, head_num=4, head_dim=192, v_head_dim=128, page_size=64)  # MiMo-V2-Flash full
    pages = 64
    with tempfile.TemporaryDirectory(prefix="hcg") as tmp:
        sock = os.path.join(tmp, "hc.sock")
        server = subprocess.Popen(
            [sys.executable, "-m", "server", "--socket", sock, "--hicache-storage-backend", "none"]
            + ["--page-size", "64", "--hicache-ratio", "2", "--log-level", "WARNING"],
            cwd=ROOT,
        )
        result: dict[str, object] = {"pages": pages, "page_bytes": g.page_bytes}
        try:
            deadline = time.monotonic() + 120
            while not (os.path.exists(sock) and check_health(f"unix://{sock}", timeout=1) == SERVING):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the sidecar did not come up")
                time.sleep(0.2)
            dev = DeviceKVPool(g, 2 * pages, "cuda")
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
                same = all(torch.equal(dev.read_page(pages + p), want[p]) for p in range(pages))
                nbytes = pages * g.page_bytes
                result.update(
                    stored=sum(s.name == "STORED" for s in r.statuses),
                    reload_statuses=sorted({s.name for s in h.statuses}),
                    bit_exact=same,
                    offload_gbps=nbytes / offload_s / 1e9,
                    layerwise_reload_gbps=nbytes / reload_s / 1e9,
                    stats=[s.copy_backend for s in client.stats()],
                )
            dev.close()
        finally:
            server.terminate()
            server.wait(60)
    Path(out_path).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result.get("bit_exact") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-ipc.json"))
