"""Storage-tier throughput as ratios to the physical limits measured in the same run.

- file tier: batch_set / batch_get GB/s against a plain sequential write / read of the
  same bytes to one file in the same folder (with fsync at the end when the tier fsyncs);
  batch_read (each page read into a reused buffer, then copied into a page buffer), and
  batch_read_into a layer_first HostKVPool (what the cache's fetch does: each file read
  with one preadv straight into the page's chunks, then verified there), against the same
  plain read into a reused buffer; read_pool_speedup is that fetch over the same one through
  the tier's buffer and write_page (tier_read_pool_copy_GBps), in the same rounds;
  read_pool_threads_speedup over the same fetch one file at a time (read_threads=1); and
  read_pool_same_dst_ratio against the plain file read page by page into the pool's own
  memory (plain_read_pool_GBps: the same destination, which is not in the CPU caches as the
  reused buffer is).
  Reads come from the page cache; a second read baseline keeps each page in a new buffer
  per batch, as batch_get must (its cost is mostly page faults on fresh memory).
- file tier from the disk (--cold, as root): batch_read_into a host pool on 1 and on the
  default read_threads threads against a plain sequential read of the same bytes, each
  round after sync and drop_caches.
- redis tier: pages/s and GB/s against a raw redis-py pipeline SET / GET of the same
  values (header included), same batch size, same server; batch_read (the cache's fetch:
  each GET received into a reused buffer, then copied into a page buffer) against the same
  raw GET; batch_set of pages in a layer_first HostKVPool, given as their pieces (what the
  storage writer does: tier_set_pool_GBps, set_pool_ratio against the raw SET) and copied
  out with read_page first (tier_set_pool_copy_GBps; set_pool_speedup is the straight set
  over that one). --repeat rounds, each timing the raw pipeline and the tier back to back; figures
  are medians, ratios the median of per-round ratios (the file tier's rounds likewise).
- redis-cluster tier: the same against a raw redis-py RedisCluster pipeline, on a local
  3-master, 3-replica cluster (or --redis-cluster-url).
- mooncake tier: set from a host pool and batch_read_into one, against Mooncake's own
  batch_put_from / batch_get_into of the same stored bytes (benchmarks/tiers_mooncake.py),
  on a local master and segment holder in a loopback-only network namespace (as root), or
  the cluster at --mooncake-master.
- --tier-secret: the file tier (fsync off) and the redis tier again with a tier secret,
  every page MAC'd with HMAC-SHA256 on write and verified on read, against the same limits.
- HostIndex: memory per key (tracemalloc) and time per allocate+bind at growing key
  counts, to show the per-key cost does not grow.

    python benchmarks/tiers.py [--backend all|file,redis,redis-cluster,mooncake] [--pages 256] [--dir /tmp]
                               [--redis-url URL] [--redis-cluster-url URL] [--mooncake-master HOST:PORT]
                               [--repeat 5] [--cold] [--tier-secret] [--json]

Without --redis-url it starts a private redis-server on a unix socket, and without
--redis-cluster-url a local cluster (each skipped if redis-server is absent). "all" (the
default) runs file and redis; redis-cluster and mooncake run only when asked for.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from hicache.cache.index import HostIndex
from hicache.geometry import KVGeometry
from hicache.pools.host import HostKVPool
from hicache.storage import TierIdentity
from hicache.storage import page_format as fmt
from hicache.storage.file import FileTier
from hicache.storage.redis import RedisTier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiers_mooncake  # noqa: E402 - beside this script

BATCH = 32
SECRET = b"a-benchmark-tier-secret-of-32-by"  # --tier-secret: pages carry its HMAC-SHA256


def geometry() -> KVGeometry:
    """MiMo-V2-Flash full-attention group, bf16, 64-token pages: K 192 / V 128, 1.47 MB."""
    return KVGeometry(layer_num=9, head_num=4, head_dim=192, v_head_dim=128, page_size=64)


def pages_of(g: KVGeometry, n: int) -> list[tuple[bytes, bytes]]:
    return [(i.to_bytes(8, "little") * 4, os.urandom(g.page_bytes)) for i in range(n)]


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_file(
    g: KVGeometry,
    items: list[tuple[bytes, bytes]],
    folder: Path,
    fsync: bool | str,
    repeat: int = 5,
    secret: bytes = b"",
) -> dict[str, Any]:
    ident = TierIdentity.for_geometry(g, "bench@0", secret=secret)
    nbytes = len(items) * g.page_bytes
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        plain = Path(tmp) / "plain.bin"

        def plain_write() -> None:
            with open(plain, "wb") as f:
                for _, data in items:
                    f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

        def plain_read() -> None:
            with open(plain, "rb") as f:
                while f.read(g.page_bytes):
                    pass

        def plain_read_kept() -> None:  # the same, but each page lands in a new buffer kept per batch
            with open(plain, "rb") as f:
                kept = []
                while data := f.read(g.page_bytes):
                    kept.append(data)
                    if len(kept) == BATCH:
                        kept = []

        tier = FileTier(ident, Path(tmp) / "tier", fsync=fsync)
        keys = [k for k, _ in items]

        def tier_write() -> None:
            for s in range(0, len(items), BATCH):
                assert all(tier.batch_set(items[s : s + BATCH]))

        def tier_read() -> None:
            for s in range(0, len(keys), BATCH):
                assert all(x is not None for x in tier.batch_get(keys[s : s + BATCH]))

        page = bytearray(g.page_bytes)  # stands in for a host page: the cache's path copies each read into one

        def into_page(_: int, data: memoryview) -> None:
            page[:] = data

        def tier_read_into() -> None:
            for s in range(0, len(keys), BATCH):
                assert tier.batch_read(keys[s : s + BATCH], into_page) == len(keys[s : s + BATCH])

        host = HostKVPool(g, len(keys), "layer_first")  # the cache's real target: a host pool
        host.flat.fill_(1)  # its memory faulted in, as a running sidecar's is

        def tier_read_pool() -> None:  # as the cache's fetch does: straight into the host pages
            for s in range(0, len(keys), BATCH):
                pieces_of = functools.partial(lambda base, i: host.page_pieces(base + i), s)
                assert tier.batch_read_into(keys[s : s + BATCH], pieces_of) == len(keys[s : s + BATCH])

        def tier_read_pool_one() -> None:  # the same, one file at a time (read_threads=1)
            threads, tier.read_threads = tier.read_threads, 1
            try:
                tier_read_pool()
            finally:
                tier.read_threads = threads

        flat = host.flat.numpy()

        def plain_read_pool() -> None:  # the plain file read page by page into the pool's own memory
            with open(plain, "rb", buffering=0) as f:
                for i in range(len(keys)):
                    f.readinto(memoryview(flat[i * g.page_bytes : (i + 1) * g.page_bytes]))

        def tier_read_pool_copy() -> None:  # the same through the tier's buffer and write_page
            for s in range(0, len(keys), BATCH):
                sink = functools.partial(lambda base, i, data: host.write_page(base + i, data), s)
                assert tier.batch_read(keys[s : s + BATCH], sink) == len(keys[s : s + BATCH])

        order = (
            plain_write,
            tier_write,
            plain_read,
            plain_read_kept,
            tier_read,
            tier_read_into,
            tier_read_pool,
            tier_read_pool_copy,
            tier_read_pool_one,
            plain_read_pool,
        )
        rounds = [[timed(fn) for fn in order] for _ in range(repeat)]  # reads all from the page cache
        tier_read_pool()
        assert bytes(host.read_page(len(keys) - 1).numpy()) == items[-1][1]
        tier.check_integrity()
    pw, tw, pr, pk, tr, ti, tp, tc, t1, pp = (statistics.median(r[i] for r in rounds) for i in range(len(order)))

    def ratio(limit: int, measured: int) -> float:
        return statistics.median(r[limit] / r[measured] for r in rounds)

    return {
        "fsync": fsync,
        "tier_secret": bool(secret),
        "pages": len(items),
        "page_bytes": g.page_bytes,
        "rounds": repeat,
        "plain_write_GBps": nbytes / pw / 1e9,
        "tier_write_GBps": nbytes / tw / 1e9,
        "write_ratio": ratio(0, 1),
        "plain_read_GBps": nbytes / pr / 1e9,
        "tier_read_GBps": nbytes / tr / 1e9,
        "read_ratio": ratio(2, 4),
        "plain_read_kept_GBps": nbytes / pk / 1e9,
        "read_ratio_kept": ratio(3, 4),
        "tier_read_into_GBps": nbytes / ti / 1e9,
        "read_into_ratio": ratio(2, 5),
        "tier_read_pool_GBps": nbytes / tp / 1e9,
        "read_pool_ratio": ratio(2, 6),
        "tier_read_pool_copy_GBps": nbytes / tc / 1e9,
        "read_pool_speedup": ratio(7, 6),
        "read_threads": tier.read_threads,
        "tier_read_pool_one_thread_GBps": nbytes / t1 / 1e9,
        "read_pool_threads_speedup": ratio(8, 6),
        "plain_read_pool_GBps": nbytes / pp / 1e9,
        "read_pool_same_dst_ratio": ratio(9, 6),
    }


def bench_file_cold(g: KVGeometry, items: list[tuple[bytes, bytes]], folder: Path, repeat: int) -> dict[str, Any] | str:
    """The file tier's batch_read_into a host pool from the disk, not the page cache (every
    round after sync and drop_caches, which needs root), on 1 and on DEFAULT_READ_THREADS
    threads, against a plain sequential read of the same bytes from one file, also cold."""
    drop = Path("/proc/sys/vm/drop_caches")

    def cold() -> None:
        os.sync()
        drop.write_text("3\n")

    try:
        cold()
    except OSError as exc:
        return f"skipped: cannot drop the page cache ({exc}); run as root"
    from hicache.storage.file import DEFAULT_READ_THREADS

    ident = TierIdentity.for_geometry(g, "bench@0")
    keys = [k for k, _ in items]
    nbytes = len(items) * g.page_bytes
    host = HostKVPool(g, len(keys), "layer_first")
    host.flat.fill_(1)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        plain = Path(tmp) / "plain.bin"
        with open(plain, "wb") as f:
            for _, data in items:
                f.write(data)
        tier = FileTier(ident, Path(tmp) / "tier", fsync=False)
        for s in range(0, len(items), BATCH):
            assert all(tier.batch_set(items[s : s + BATCH]))

        def plain_read() -> None:
            with open(plain, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass

        def tier_read(threads: int) -> None:
            tier.read_threads = threads
            for s in range(0, len(keys), BATCH):
                pieces_of = functools.partial(lambda base, i: host.page_pieces(base + i), s)
                assert tier.batch_read_into(keys[s : s + BATCH], pieces_of) == len(keys[s : s + BATCH])

        buf = bytearray(g.page_bytes)
        fns = (plain_read, functools.partial(tier_read, 1), functools.partial(tier_read, DEFAULT_READ_THREADS))
        rounds = []
        for _ in range(repeat):
            row = []
            for fn in fns:
                cold()
                row.append(timed(fn))
            rounds.append(row)
        tier.close()
    pr, t1, tn = (statistics.median(r[i] for r in rounds) for i in range(3))
    return {
        "pages": len(items),
        "rounds": repeat,
        "read_threads": DEFAULT_READ_THREADS,
        "plain_read_GBps": nbytes / pr / 1e9,
        "tier_read_pool_one_thread_GBps": nbytes / t1 / 1e9,
        "tier_read_pool_GBps": nbytes / tn / 1e9,
        "read_pool_ratio": statistics.median(r[0] / r[2] for r in rounds),
        "read_pool_one_thread_ratio": statistics.median(r[0] / r[1] for r in rounds),
    }


def bench_redis(
    g: KVGeometry,
    items: list[tuple[bytes, bytes]],
    url: str,
    cluster: bool = False,
    repeat: int = 5,
    secret: bytes = b"",
) -> dict[str, Any]:
    import redis
    from redis.cluster import RedisCluster

    ident = TierIdentity.for_geometry(g, "bench@0", secret=secret)
    tier = RedisTier(ident, url, cluster=cluster, timeout_s=30)
    raw: Any = (
        RedisCluster.from_url(url, socket_timeout=30) if cluster else redis.Redis.from_url(url, socket_timeout=30)
    )
    raw.flushall()
    values = [(b"raw:" + k, fmt.encode_page(ident, k, d)) for k, d in items]
    nbytes, n = len(items) * g.page_bytes, len(items)

    def raw_set() -> None:
        for s in range(0, n, BATCH):
            pipe = raw.pipeline(transaction=False)
            for k, v in values[s : s + BATCH]:
                pipe.set(k, v)
            pipe.execute()

    def raw_get() -> None:
        for s in range(0, n, BATCH):
            pipe = raw.pipeline(transaction=False)
            for k, _ in values[s : s + BATCH]:
                pipe.get(k)
            assert all(x is not None for x in pipe.execute())

    def tier_set() -> None:
        for s in range(0, n, BATCH):
            assert all(tier.batch_set(items[s : s + BATCH]))

    def tier_get() -> None:
        keys = [k for k, _ in items]
        for s in range(0, n, BATCH):
            assert all(x is not None for x in tier.batch_get(keys[s : s + BATCH]))

    page = bytearray(g.page_bytes)  # stands in for a host page, as in bench_file

    def into_page(_: int, data: memoryview) -> None:
        page[:] = data

    def tier_read() -> None:
        keys = [k for k, _ in items]
        for s in range(0, n, BATCH):
            assert tier.batch_read(keys[s : s + BATCH], into_page) == len(keys[s : s + BATCH])

    host = HostKVPool(g, n, "layer_first")  # the storage writer's source: pages in a host pool
    for i, (_, data) in enumerate(items):
        host.write_page(i, data)

    def tier_set_pool() -> None:  # as the writer does: each page's 18 pieces, straight from the pool
        for s in range(0, n, BATCH):
            assert all(tier.batch_set([(items[i][0], host.page_pieces(i)) for i in range(s, min(s + BATCH, n))]))

    def tier_set_pool_copy() -> None:  # the same pages copied out first (read_page), as before
        for s in range(0, n, BATCH):
            batch = [(items[i][0], memoryview(host.read_page(i).numpy())) for i in range(s, min(s + BATCH, n))]
            assert all(tier.batch_set(batch))

    rounds = []  # each round times the raw pipeline and the tier back to back: ratios per round
    for _ in range(repeat):
        rs, ts = timed(raw_set), timed(tier_set)
        rg, tg, tr = timed(raw_get), timed(tier_get), timed(tier_read)
        tp, tc = timed(tier_set_pool), timed(tier_set_pool_copy)
        rounds.append((rs, ts, rg, tg, tr, tp, tc))
    assert bytes(tier.get(items[-1][0]) or b"") == items[-1][1]
    raw.flushall()
    raw.close()
    tier.close()
    rs, ts, rg, tg, tr, tp, tc = (statistics.median(r[i] for r in rounds) for i in range(7))
    return {
        "pages": n,
        "rounds": repeat,
        "raw_set_pages_per_s": n / rs,
        "tier_set_pages_per_s": n / ts,
        "raw_set_GBps": nbytes / rs / 1e9,
        "tier_set_GBps": nbytes / ts / 1e9,
        "set_ratio": statistics.median(r[0] / r[1] for r in rounds),
        "raw_get_pages_per_s": n / rg,
        "tier_get_pages_per_s": n / tg,
        "raw_get_GBps": nbytes / rg / 1e9,
        "tier_get_GBps": nbytes / tg / 1e9,
        "get_ratio": statistics.median(r[2] / r[3] for r in rounds),
        "tier_read_into_GBps": nbytes / tr / 1e9,
        "read_into_ratio": statistics.median(r[2] / r[4] for r in rounds),
        "tier_set_pool_GBps": nbytes / tp / 1e9,
        "set_pool_ratio": statistics.median(r[0] / r[5] for r in rounds),
        "tier_set_pool_copy_GBps": nbytes / tc / 1e9,
        "set_pool_speedup": statistics.median(r[6] / r[5] for r in rounds),
    }


def bench_index(counts: list[int]) -> list[dict[str, Any]]:
    out = []
    for n in counts:
        keys = [i.to_bytes(32, "little") for i in range(n)]  # made before measuring: not index cost
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        index = HostIndex(n)
        t = time.perf_counter()
        got = index.allocate(n)
        assert got is not None
        for k, p in zip(keys, got[0], strict=True):
            index.bind(k, p)
        fill_s = time.perf_counter() - t
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        t = time.perf_counter()
        for k in keys[::7]:
            index.touch(k)
        touch_s = (time.perf_counter() - t) / len(keys[::7])
        t = time.perf_counter()
        evicted = index.evict(n // 2)
        evict_s = (time.perf_counter() - t) / max(1, len(evicted))
        index.check_integrity() if n <= 100_000 else None
        out.append(
            {
                "keys": n,
                "bytes_per_key": used / n,
                "allocate_bind_us_per_key": fill_s / n * 1e6,
                "touch_us": touch_s * 1e6,
                "evict_us_per_key": evict_s * 1e6,
            }
        )
        del index, keys, got, evicted
    return out


def start_redis(tmp: str) -> tuple[subprocess.Popen[bytes], str] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    sock = os.path.join(tmp, "redis.sock")
    proc = subprocess.Popen(
        [exe, "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no", "--dir", tmp],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not os.path.exists(sock):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            return None
        time.sleep(0.02)
    return proc, f"unix://{sock}"


def bench_cluster(g: KVGeometry, items: list[tuple[bytes, bytes]], url: str, repeat: int) -> dict[str, Any] | str:
    """bench_redis on a cluster: the one at `url`, else a local 3+3 cluster started here."""
    if url:
        return bench_redis(g, items, url, cluster=True, repeat=repeat)
    from hicache.demo.redis_cluster import LocalRedisCluster

    with tempfile.TemporaryDirectory() as tmp:
        try:
            cluster = LocalRedisCluster(tmp)
        except FileNotFoundError as exc:
            return f"skipped: {exc}"
        with cluster:
            return bench_redis(g, items, cluster.url, cluster=True, repeat=repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="folder for the file tier and the plain file")
    ap.add_argument(
        "--backend",
        default="all",
        help="all, or a comma-separated list of file, redis, redis-cluster, mooncake (e.g. redis,redis-cluster,mooncake)",
    )
    ap.add_argument("--redis-url", default="")
    ap.add_argument("--redis-cluster-url", default="", help="a node of a running cluster (default: start one)")
    ap.add_argument("--mooncake-master", default="", help="a running master host:port (default: start one)")
    ap.add_argument("--index-keys", default="100000,1000000", help="comma-separated key counts")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of each tier's benchmark")
    ap.add_argument("--cold", action="store_true", help="also the file tier's reads from the disk (root: drops caches)")
    ap.add_argument("--tier-secret", action="store_true", help="also the file and redis tiers with a tier secret")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    g = geometry()
    items = pages_of(g, args.pages)
    result: dict[str, Any] = {"geometry": g.to_dict(), "batch": BATCH}
    wanted: set[str] = set()
    for name in args.backend.split(","):
        if name not in ("all", "file", "redis", "redis-cluster", "mooncake"):
            ap.error(f"--backend: unknown backend {name!r}")
        wanted |= {"all": {"file", "redis", "index"}, "file": {"file", "index"}}.get(name, {name})
    if "mooncake" in wanted:  # first: it may move this process into a network namespace of its own
        result["mooncake"] = tiers_mooncake.run(g, items[:128], args.mooncake_master, args.repeat)
    if "file" in wanted:
        result["file"] = [bench_file(g, items, Path(args.dir), fsync, args.repeat) for fsync in (False, True, "batch")]
        if args.tier_secret:
            result["file"].append(bench_file(g, items, Path(args.dir), False, args.repeat, SECRET))
        if args.cold:
            result["file_cold"] = bench_file_cold(g, items, Path(args.dir), args.repeat)
    if "redis" in wanted:
        with tempfile.TemporaryDirectory() as tmp:
            server = None if args.redis_url else start_redis(tmp)
            url = args.redis_url or (server[1] if server else "")
            try:
                result["redis"] = (
                    bench_redis(g, items[:128], url, repeat=args.repeat) if url else "skipped: no redis-server"
                )
                if url and args.tier_secret:
                    result["redis_secret"] = bench_redis(g, items[:128], url, repeat=args.repeat, secret=SECRET)
            finally:
                if server:
                    server[0].terminate()
                    server[0].wait()
    if "redis-cluster" in wanted:
        result["redis_cluster"] = bench_cluster(g, items[:128], args.redis_cluster_url, args.repeat)
    if "index" in wanted:
        result["index"] = bench_index([int(x) for x in args.index_keys.split(",")])
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return
    print(f"page {g.page_bytes / 1e6:.2f} MB (MiMo-V2-Flash full, bf16, 64 tokens), batches of {BATCH}")
    for r in result.get("file", []):
        print(
            f"file tier fsync={r['fsync']!s:5}{' with a tier secret' if r['tier_secret'] else ''}: write {r['tier_write_GBps']:.2f} GB/s vs plain "
            f"{r['plain_write_GBps']:.2f} (ratio {r['write_ratio']:.2f}); read {r['tier_read_GBps']:.2f} "
            f"vs {r['plain_read_GBps']:.2f} (ratio {r['read_ratio']:.2f}; vs {r['plain_read_kept_GBps']:.2f} "
            f"into kept buffers, ratio {r['read_ratio_kept']:.2f}); batch_read into a page "
            f"{r['tier_read_into_GBps']:.2f} (ratio {r['read_into_ratio']:.2f}); into a layer_first host pool "
            f"{r['tier_read_pool_GBps']:.2f} (ratio {r['read_pool_ratio']:.2f}; through write_page "
            f"{r['tier_read_pool_copy_GBps']:.2f}, {r['read_pool_speedup']:.2f} x slower; on one thread "
            f"{r['tier_read_pool_one_thread_GBps']:.2f}, {r['read_threads']} threads {r['read_pool_threads_speedup']:.2f} x "
            f"faster; plain read into the pool {r['plain_read_pool_GBps']:.2f}, ratio {r['read_pool_same_dst_ratio']:.2f})"
        )
    cold = result.get("file_cold")
    if isinstance(cold, dict):
        print(
            f"file tier from the disk (page cache dropped): batch_read_into a host pool {cold['tier_read_pool_GBps']:.2f} "
            f"GB/s on {cold['read_threads']} threads, {cold['tier_read_pool_one_thread_GBps']:.2f} on one; plain "
            f"sequential read {cold['plain_read_GBps']:.2f} (ratios {cold['read_pool_ratio']:.2f} / "
            f"{cold['read_pool_one_thread_ratio']:.2f})"
        )
    elif cold is not None:
        print(f"file tier from the disk: {cold}")
    r = result.get("mooncake")
    if isinstance(r, dict):
        print(
            f"mooncake tier: set from a host pool {r['tier_set_pool_GBps']:.2f} GB/s vs Mooncake's batch_put_from "
            f"{r['raw_put_GBps']:.2f} (ratio {r['set_pool_ratio']:.2f}); batch_read_into a host pool "
            f"{r['tier_read_pool_GBps']:.2f} vs batch_get_into {r['raw_get_GBps']:.2f} (ratio {r['read_pool_ratio']:.2f})"
        )
    elif r is not None:
        print(f"mooncake tier: {r}")
    for name, label in (
        ("redis", "redis tier"),
        ("redis_secret", "redis tier with a tier secret"),
        ("redis_cluster", "redis-cluster tier (3+3 nodes)"),
    ):
        r = result.get(name)
        if isinstance(r, dict):
            print(
                f"{label}: set {r['tier_set_pages_per_s']:.0f} pages/s {r['tier_set_GBps']:.2f} GB/s vs raw "
                f"{r['raw_set_GBps']:.2f} (ratio {r['set_ratio']:.2f}); get {r['tier_get_pages_per_s']:.0f} pages/s "
                f"{r['tier_get_GBps']:.2f} GB/s vs raw {r['raw_get_GBps']:.2f} (ratio {r['get_ratio']:.2f}); "
                f"batch_read into a page {r['tier_read_into_GBps']:.2f} (ratio {r['read_into_ratio']:.2f})"
            )
        elif r is not None:
            print(f"{label}: {r}")
    for r in result.get("index", []):
        print(
            f"HostIndex {r['keys']:>9,} keys: {r['bytes_per_key']:.0f} B/key, allocate+bind "
            f"{r['allocate_bind_us_per_key']:.2f} us/key, touch {r['touch_us']:.2f} us, "
            f"evict {r['evict_us_per_key']:.2f} us/key"
        )


if __name__ == "__main__":
    main()
