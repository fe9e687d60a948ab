"""The Mooncake tier's throughput against Mooncake's own zero-copy calls on the same bytes
(benchmarks/tiers.py --backend mooncake).

The cluster: a local mooncake_master and a second process that lends the memory
(`--holder`: a Mooncake client with a segment, as a store server would be), started in a
loopback-only network namespace, or the cluster at --mooncake-master. The measuring client
lends none, so every page crosses a process boundary over Mooncake's TCP transfer.

Each round, on the same stored pages (header + key + payload, as the tier stores them):
- raw put: batch_put_from of the stored pages from one registered buffer, BATCH at a time;
- tier set: MooncakeTier.batch_set of the same pages given as their layer_first host-pool
  pieces (what the storage writer does: 18 pieces a page, so the tier stages them, copied
  and hashed in one pass into a registered buffer, then one put);
- raw get: batch_get_into the same registered buffer;
- tier read: MooncakeTier.batch_read_into the host pool's page pieces (the cache's fetch: one
  get into the staging buffer, each page verified as it is copied out into its pieces).
Objects are removed (untimed) before each put, since Mooncake keeps an existing object.
Ratios are raw time / tier time, the median of per-round ratios.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache.geometry import KVGeometry
from hicache.pools.host import HostKVPool
from hicache.storage import TierIdentity
from hicache.storage import page_format as fmt

BATCH = 32
HOLDER_SEGMENT = 4 << 30  # the holder's lent memory: the pages, raw and the tier's, fit many times


def holder(master: str) -> None:
    """A Mooncake client that lends HOLDER_SEGMENT bytes until its stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", HOLDER_SEGMENT, 16 << 20, "tcp", "", master)
    print(f"ready {rc}", flush=True)
    sys.stdin.read()
    store.close()


def start_holder(master: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--holder", master],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready 0":
        proc.kill()
        raise RuntimeError(f"the Mooncake segment holder did not start: {line!r}")
    return proc


def bench_mooncake(g: KVGeometry, items: list[tuple[bytes, bytes]], master: str, repeat: int) -> dict[str, Any]:
    from hicache.storage.mooncake import MooncakeTier

    ident = TierIdentity.for_geometry(g, "bench@0")
    tier = MooncakeTier(ident, {"master_server_address": master, "global_segment_size": 0})
    raw = tier._link.ready()  # the same client: raw and tier calls share its connections
    n, nbytes = len(items), len(items) * g.page_bytes
    host = HostKVPool(g, n, "layer_first")  # the writer's source and the fetch's destination
    for i, (_, data) in enumerate(items):
        host.write_page(i, data)
    stored = [fmt.encode_page(ident, k, d) for k, d in items]
    size = len(stored[0])
    buffer = np.frombuffer(b"".join(stored), dtype=np.uint8).copy()
    assert raw.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0
    raw_keys = [f"raw:{k.hex()}" for k, _ in items]
    tier_keys = [k for k, _ in items]
    ptrs = [buffer.ctypes.data + i * size for i in range(n)]

    def batches() -> range:
        return range(0, n, BATCH)

    def raw_put() -> None:
        for s in batches():
            assert raw.batch_put_from(
                raw_keys[s : s + BATCH], ptrs[s : s + BATCH], [size] * len(ptrs[s : s + BATCH])
            ) == [0] * len(ptrs[s : s + BATCH])

    def raw_get() -> None:
        for s in batches():
            got = raw.batch_get_into(raw_keys[s : s + BATCH], ptrs[s : s + BATCH], [size] * len(ptrs[s : s + BATCH]))
            assert got == [size] * len(ptrs[s : s + BATCH]), got

    def tier_set() -> None:
        for s in batches():
            assert all(tier.batch_set([(tier_keys[i], host.page_pieces(i)) for i in range(s, min(s + BATCH, n))]))

    def tier_read() -> None:
        for s in batches():
            keys = tier_keys[s : s + BATCH]
            assert tier.batch_read_into(keys, lambda i, at=s: host.page_pieces(at + i)) == len(keys)

    def clear() -> None:
        raw.batch_remove(raw_keys, True)
        raw.batch_remove([tier.name(k) for k in tier_keys], True)

    def timed(fn: Any) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    rounds = []
    for _ in range(repeat):
        clear()
        rp, ts = timed(raw_put), timed(tier_set)
        rg, tr = timed(raw_get), timed(tier_read)
        rounds.append((rp, ts, rg, tr))
    probe = bytearray(g.page_bytes)
    assert tier.batch_read_into(tier_keys[-1:], lambda i: [memoryview(probe)]) == 1 and probe == items[-1][1]
    clear()
    raw.unregister_buffer(buffer.ctypes.data)
    tier.close()
    rp, ts, rg, tr = (statistics.median(r[i] for r in rounds) for i in range(4))
    return {
        "pages": n,
        "rounds": repeat,
        "raw_put_GBps": nbytes / rp / 1e9,
        "tier_set_pool_GBps": nbytes / ts / 1e9,
        "set_pool_ratio": statistics.median(r[0] / r[1] for r in rounds),
        "raw_get_GBps": nbytes / rg / 1e9,
        "tier_read_pool_GBps": nbytes / tr / 1e9,
        "read_pool_ratio": statistics.median(r[2] / r[3] for r in rounds),
    }


def run(g: KVGeometry, items: list[tuple[bytes, bytes]], master: str, repeat: int) -> dict[str, Any] | str:
    """bench_mooncake on the cluster at `master`, else on a local master and segment holder
    in a loopback-only network namespace (as root)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"skipped: {exc} (pip install mooncake-transfer-engine-non-cuda)"
    if master:
        return bench_mooncake(g, items, master, repeat)
    from hicache.demo.mooncake_local import LocalMooncakeMaster, enter_loopback_namespace

    enter_loopback_namespace()
    with tempfile.TemporaryDirectory() as tmp, LocalMooncakeMaster(Path(tmp)) as local:
        held = start_holder(local.address)
        try:
            return bench_mooncake(g, items, local.address, repeat)
        finally:
            assert held.stdin is not None
            held.stdin.close()
            held.wait(timeout=60)


if __name__ == "__main__" and sys.argv[1:2] == ["--holder"]:
    holder(sys.argv[2])
