"""The connection keys every engine adapter reads from its engine's extra config, checked the
same way for each: where the sidecar is (target, default $HICACHE_SOCKET, else the server's
default socket), its token (default $HICACHE_TOKEN), and strings and durations by name."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from hicache.paths import default_socket_path


def adapter_options(
    extra: Mapping[str, Any],
    fields: Iterable[str],
    where: str,
    *,
    strings: Iterable[str] = ("token", "model_id", "model_config"),
    seconds: Iterable[str] = ("timeout_s",),
) -> dict[str, Any]:
    """The keys of `extra` that are in `fields`, with target and token defaulted. `where`
    names the config in messages ("extra config", "kv_connector_extra_config"). Raises
    ValueError naming the key: target or namespace not a (non-empty) string, one of
    `strings` not a string or None, one of `seconds` not a finite number > 0."""
    names = set(fields)
    mine = {k: v for k, v in extra.items() if k in names}
    mine.setdefault("target", os.environ.get("HICACHE_SOCKET") or default_socket_path())
    mine.setdefault("token", os.environ.get("HICACHE_TOKEN"))
    for key in ("target", "namespace"):
        if not isinstance(mine.get(key, ""), str) or (key == "target" and not mine[key]):
            raise ValueError(f"{where} {key!r} must be a non-empty string, got {mine.get(key)!r}")
    for key in strings:
        if mine.get(key) is not None and not isinstance(mine[key], str):
            raise ValueError(f"{where} {key!r} must be a string, got {mine[key]!r}")
    for key in seconds:
        value = mine.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{where} {key!r} must be a number > 0, got {value!r}")
    return mine
