"""The `hicache` command line: demo, replay, geometry, health, stats and events."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import TYPE_CHECKING

from hicache._version import __version__
from hicache.paths import default_socket_path

if TYPE_CHECKING:
    from hicache.client.tls import ClientTls

# The variables the `hicache` command reads (the server's are in hicache_server.envflags).
CLIENT_VARIABLES = ("HICACHE_SOCKET", "HICACHE_TOKEN")


def seconds(text: str) -> float:
    """A --timeout or --duration: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        "--socket",
        dest="target",
        default=os.environ.get("HICACHE_SOCKET") or default_socket_path(),
        help="sidecar socket path or gRPC target ($HICACHE_SOCKET, else the server's default socket)",
    )
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for the answer")


def _add_tls(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle: reach a --listen served over TLS (--tls-cert)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate, for a sidecar that asks for one (mTLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-server-name", default=None, help="name to check the sidecar's certificate against")


def _tls(args: argparse.Namespace) -> ClientTls | None:
    """The TLS options as a ClientTls, None without --tls-ca. Raises ValueError for a
    certificate or server name without --tls-ca, or what ClientTls refuses."""
    if args.tls_ca is None:
        others = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-server-name": args.tls_server_name}
        given = [flag for flag, value in others.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --tls-ca (the CA that signed the sidecar's certificate)")
        return None
    from hicache.client.tls import ClientTls

    return ClientTls(args.tls_ca, cert=args.tls_cert, key=args.tls_key, server_name=args.tls_server_name)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="hicache", description="Hierarchical KV-cache offloading for LLM serving", formatter_class=fmt
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        formatter_class=fmt,
        help="run a sidecar and an example engine over a multi-turn chat, verifying every page",
    )
    from hicache.demo.run import add_arguments

    add_arguments(demo)
    replay = sub.add_parser(
        "replay",
        formatter_class=fmt,
        help="replay a KV-cache trace through real sidecars; compare with an exact prefix LRU of the same size",
    )
    from hicache.replay.run import add_arguments as add_replay_arguments

    add_replay_arguments(replay)
    geometry = sub.add_parser("geometry", formatter_class=fmt, help="print the KV geometry of an HF config.json")
    geometry.add_argument("config", help="a Hugging Face config.json")
    geometry.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks")
    geometry.add_argument("--page-size", type=int, default=64, help="tokens per page")
    geometry.add_argument("--dtype", default="bfloat16", help="KV cache dtype")
    health = sub.add_parser(
        "health", formatter_class=fmt, help="exit 0 only if the sidecar's health service says SERVING"
    )
    _add_target(health)
    _add_tls(health)
    health.add_argument("--service", default="", help="service name to ask about ('' is the whole server)")
    stats = sub.add_parser("stats", formatter_class=fmt, help="print the stats of every pool on a running sidecar")
    _add_target(stats)
    _add_tls(stats)
    stats.add_argument("--token", default=None, help="shared token (unset: $HICACHE_TOKEN; never shown here)")
    stats.add_argument(
        "--admin-token",
        default=None,
        help="the sidecar's --admin-token (unset: $HICACHE_ADMIN_TOKEN; never shown here)",
    )
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    events = sub.add_parser(
        "events", formatter_class=fmt, help="follow a sidecar's KV events (JSON lines), as a router would"
    )
    events.add_argument(
        "target",
        nargs="?",
        default=os.environ.get("HICACHE_SOCKET") or default_socket_path(),
        help="sidecar socket path or gRPC target ($HICACHE_SOCKET, else the server's default socket)",
    )
    events.add_argument("--namespace", default=None, help="only this tenant's pools (unset: every namespace)")
    events.add_argument("--no-snapshot", action="store_true", help="changes only, not what each pool holds now")
    events.add_argument("--duration", type=seconds, default=None, help="stop after this many seconds")
    events.add_argument("--token", default=None, help="shared token (unset: $HICACHE_TOKEN; never shown here)")
    events.add_argument(
        "--admin-token", default=None, help="the sidecar's --admin-token (unset: $HICACHE_ADMIN_TOKEN; never shown)"
    )
    _add_tls(events)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from hicache.demo.run import run_demo

            return run_demo(args)
        if args.command == "replay":
            from hicache.replay.run import run_replay

            return run_replay(args)
        if args.command == "geometry":
            from hicache.demo import print_geometry

            return print_geometry(args)
        if args.command == "health":
            from hicache.client.health import ask_health

            answer = ask_health(args.target, service=args.service, timeout=args.timeout, tls=_tls(args))
            print(answer.status)
            return health_exit_code(answer.status, call_failed=answer.call_failed)
        if args.command == "events":
            from hicache.client.events_cli import print_events

            return print_events(
                args.target,
                namespace=args.namespace,
                snapshot=not args.no_snapshot,
                duration=args.duration,
                token=args.token or os.environ.get("HICACHE_TOKEN"),
                admin_token=args.admin_token or os.environ.get("HICACHE_ADMIN_TOKEN"),
                tls=_tls(args),
            )
        from hicache.client.stats_cli import print_stats

        return print_stats(
            args.target,
            token=args.token or os.environ.get("HICACHE_TOKEN"),
            admin_token=args.admin_token or os.environ.get("HICACHE_ADMIN_TOKEN"),
            as_json=args.json,
            timeout=args.timeout,
            tls=_tls(args),
        )
    except (ValueError, OSError) as exc:
        print(f"hicache: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hicache: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        from hicache.client import HiCacheRpcError

        if not isinstance(exc, HiCacheRpcError):
            raise
        print(f"hicache: error: the sidecar said {_one_line(exc)}", file=sys.stderr)
        return 2


def health_exit_code(status: str, *, call_failed: bool | None = None) -> int:
    """grpc_health_probe's exit codes: 0 SERVING, 2 no connection, 3 the call failed
    otherwise, 4 answered but not SERVING. call_failed: whether `status` is the gRPC code of
    a failed call rather than a serving status (None: tell them apart by name, where the
    ambiguous UNKNOWN counts as an answer)."""
    answered = ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN", "UNKNOWN")
    if call_failed is None:
        call_failed = status not in answered
    if not call_failed:
        return 0 if status == "SERVING" else 4
    return 2 if status in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else 3


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
