"""Build a storage tier from a backend name and its extra-config dict."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicache.storage.base import StorageTier, TierIdentity

BACKENDS = ("file", "redis", "none")
# extra-config keys each backend accepts
BACKEND_OPTIONS: dict[str, tuple[str, ...]] = {
    "file": ("dir", "max_bytes", "fsync"),
    "redis": ("url", "timeout_s", "ttl_s", "backoff_initial_s", "backoff_max_s"),
    "none": (),
}


def default_file_dir() -> Path:
    """$XDG_CACHE_HOME/hicache, else ~/.cache/hicache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache"


def check_extra(backend: str, extra: Mapping[str, Any]) -> None:
    """Raise ValueError for an unknown backend, an unknown key, a missing redis url, or a
    bad option value (the tiers' own checks, run without making a tier)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown storage backend {backend!r}; expected one of {list(BACKENDS)}")
    unknown = sorted(set(extra) - set(BACKEND_OPTIONS[backend]))
    if unknown:
        raise ValueError(
            f"unknown extra-config key(s) {unknown} for storage backend {backend!r}; "
            f"expected some of {list(BACKEND_OPTIONS[backend])}"
        )
    if backend == "redis" and not extra.get("url"):
        raise ValueError('storage backend "redis" needs "url" in its extra config (redis://... or unix://...)')
    if backend == "file":
        from hicache.storage import file

        file.check_options(extra.get("dir") or default_file_dir(), extra.get("max_bytes"), extra.get("fsync", True))
    if backend == "redis":
        from hicache.storage import redis

        defaults = {"timeout_s": 1.0, "ttl_s": None, "backoff_initial_s": 0.1, "backoff_max_s": 10.0}
        options = {**defaults, **{k: v for k, v in extra.items() if k != "url"}}
        redis.check_options(extra["url"], **options)


def make_tier(backend: str, extra: Mapping[str, Any], identity: TierIdentity) -> StorageTier:
    """A tier of `backend` ("file", "redis" or "none") for `identity`.

    extra for file: {"dir": PATH, "max_bytes": N, "fsync": bool}; for redis: {"url": ...,
    "timeout_s": ..., "ttl_s": ..., "backoff_initial_s": ..., "backoff_max_s": ...}.
    Raises ValueError naming a bad backend, key or value.
    """
    check_extra(backend, extra)
    if backend == "file":
        from hicache.storage.file import FileTier

        directory = extra.get("dir") or default_file_dir()
        return FileTier(identity, directory, max_bytes=extra.get("max_bytes"), fsync=extra.get("fsync", True))
    if backend == "redis":
        from hicache.storage.redis import RedisTier

        opts = {k: v for k, v in extra.items() if k != "url"}
        return RedisTier(identity, extra["url"], **opts)
    from hicache.storage.null import NullTier

    return NullTier(identity)
