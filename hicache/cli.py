"""The `hicache` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache", description="Hierarchical KV-cache offloading for LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offload and reload KV pages and verify them bit for bit")
    demo.add_argument("--config", help="HF config.json (default: the bundled MiMo-V2-Flash config)")
    demo.add_argument("--tp-size", type=int, default=1)
    demo.add_argument("--page-size", type=int, default=64)
    demo.add_argument("--dtype", default="bfloat16")
    demo.add_argument("--layout", default="layer_first")
    demo.add_argument("--device-pages", type=int, default=64)
    demo.add_argument("--host-pages", type=int, default=128)
    demo.add_argument("--seed", type=int, default=0)
    geometry = sub.add_parser("geometry", help="print the KV geometry of an HF config.json")
    geometry.add_argument("config")
    geometry.add_argument("--tp-size", type=int, default=1)
    geometry.add_argument("--page-size", type=int, default=64)
    geometry.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from hicache.demo import run_demo

            return run_demo(args)
        from hicache.demo import print_geometry

        return print_geometry(args)
    except (ValueError, OSError) as exc:
        print(f"hicache: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
