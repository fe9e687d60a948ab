"""Every `hicache-server` flag can also come from the environment.

The rule: drop the leading dashes and a leading "hicache-", upper-case, "-" -> "_", and
prefix HICACHE_. So --hicache-ratio is HICACHE_RATIO, --socket is HICACHE_SOCKET,
--hicache-storage-backend is HICACHE_STORAGE_BACKEND and --log-level is HICACHE_LOG_LEVEL.
A flag on the command line wins over its variable. A switch (--insecure) takes 1/true/yes/on
or 0/false/no/off/"".
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_name(flag: str) -> str:
    """The variable of a long flag: "--hicache-ratio" -> "HICACHE_RATIO"."""
    if not flag.startswith("--") or len(flag) < 3:
        raise ValueError(f"expected a long flag such as --socket, got {flag!r}")
    name = flag[2:].removeprefix("hicache-")
    return "HICACHE_" + name.upper().replace("-", "_")


def _long_flags(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    out = []
    # argparse has no public list of its actions; ConfigArgParse would do the env mapping but
    # brings its own config-file syntax, and this rule is 20 lines: kept
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--") and s not in ("--help", "--version")]
        if longs:
            out.append((longs[0], action))
    return out


def document(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Append "[env HICACHE_X]" to every flag's help, and the rule to the epilog."""
    for flag, action in _long_flags(parser):
        action.help = f"{action.help or ''} [env {env_name(flag)}]".strip()
    parser.epilog = (
        "Every flag can also be set by an environment variable: drop the dashes and a leading "
        "'hicache-', upper-case, '-' becomes '_', prefix HICACHE_ (--hicache-ratio: HICACHE_RATIO, "
        "--socket: HICACHE_SOCKET). The command line wins."
    )
    return parser


def env_argv(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """Command-line arguments equivalent to the HICACHE_* variables in `environ` that name
    a flag of `parser`; put them before the real arguments so that those win.
    Raises ValueError naming the variable for a switch whose value is not a boolean, or a
    value the flag's type or choices refuse."""
    out: list[str] = []
    for flag, action in _long_flags(parser):
        name = env_name(flag)
        if name not in environ:
            continue
        value = environ[name]
        if action.nargs == 0:  # a switch: store_true / store_false
            if value.strip().lower() in _TRUE:
                out.append(flag)
            elif value.strip().lower() not in _FALSE:
                raise ValueError(f"{name}={value!r}: expected one of {_TRUE + _FALSE[:-1]}")
        else:
            _check_value(name, flag, action, value)
            out.append(f"{flag}={value}")
    return out


def _check_value(name: str, flag: str, action: argparse.Action, value: str) -> None:
    """Raises ValueError naming the variable for a value argparse would refuse (it would
    name only the flag, and the user never typed one)."""
    if callable(action.type):
        try:
            action.type(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            kind = getattr(action.type, "__name__", "value")
            raise ValueError(f"{name}={value!r}: {flag} takes a {kind}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{name}={value!r}: {flag} takes one of {list(action.choices)}")


def unknown_variables(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """HICACHE_* variables in `environ` that name no flag of `parser` (likely typos)."""
    known = {env_name(flag) for flag, _ in _long_flags(parser)}
    return sorted(k for k in environ if k.startswith("HICACHE_") and k not in known)
