"""The page checksum (XXH3-64) per stripe loop, against python-xxhash and a read of the same bytes.

    python benchmarks/checksum.py [--page-bytes 1474560] [--pages 200] [--repeat 300] [--json]

For each loop the C extension hicache.storage._xxh3 can run on this CPU (portable, avx2,
avx512) and for python-xxhash, the GB/s of hashing one page over and over ("hot": in the
CPU's caches, as the file tier's fetch hashes each window it has just read) and of hashing
`--pages` distinct pages in turn ("cold": from memory, as a Redis set hashes a host page).
The limits, measured in the same run on the same bytes: python-xxhash (the reference
implementation; ratio_to_xxhash) and numpy's copy of the page into a reused buffer, which
reads every byte once as the hash does (ratio_to_copy). Each figure is the median of
--repeat calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hicache.storage import _xxh3  # noqa: E402


def gbps(fn: Callable[[bytes], object], pages: list[bytes], repeat: int) -> float:
    times = []
    for i in range(repeat):
        page = pages[i % len(pages)]
        t = time.perf_counter()
        fn(page)
        times.append(time.perf_counter() - t)
    return len(pages[0]) / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-bytes", type=int, default=1474560, help="default: a MiMo-V2-Flash full-attention page")
    p.add_argument("--pages", type=int, default=200, help="distinct pages for the cold figures")
    p.add_argument("--repeat", type=int, default=300)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if _xxh3 is None:
        sys.exit("hicache.storage._xxh3 is not built (pip install -e . builds it)")
    cold = [os.urandom(args.page_bytes) for _ in range(args.pages)]
    hot = cold[:1]
    out: dict[str, Any] = {"page_bytes": args.page_bytes, "pages": args.pages, "repeat": args.repeat}
    sink = np.empty(args.page_bytes, dtype=np.uint8)

    def copy(b: bytes) -> None:
        np.copyto(sink, np.frombuffer(b, dtype=np.uint8))

    before = _xxh3.set_loop("best")
    try:
        for where, pages in (("hot", hot), ("cold", cold)):
            base = {
                "copy": gbps(copy, pages, args.repeat),
                "xxhash": gbps(xxhash.xxh3_64_intdigest, pages, args.repeat),
            }
            for name in _xxh3.loops():
                _xxh3.set_loop(name)
                got = gbps(lambda b: _xxh3.xxh3_64_long([b]), pages, args.repeat)
                out[f"{name}_{where}_GBps"] = got
                out[f"{name}_{where}_ratio_to_xxhash"] = got / base["xxhash"]
                out[f"{name}_{where}_ratio_to_copy"] = got / base["copy"]
            out[f"xxhash_{where}_GBps"] = base["xxhash"]
            out[f"copy_{where}_GBps"] = base["copy"]
    finally:
        _xxh3.set_loop(before)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for where in ("hot", "cold"):
        print(
            f"{where}: python-xxhash {out[f'xxhash_{where}_GBps']:.1f} GB/s, copy {out[f'copy_{where}_GBps']:.1f} GB/s"
        )
        for name in _xxh3.loops():
            print(
                f"  {name:8s} {out[f'{name}_{where}_GBps']:6.1f} GB/s  {out[f'{name}_{where}_ratio_to_xxhash']:.2f} of "
                f"python-xxhash, {out[f'{name}_{where}_ratio_to_copy']:.2f} of the copy"
            )


if __name__ == "__main__":
    main()
