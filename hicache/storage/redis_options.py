"""The Redis tier's options, checked without connecting: the URL (one server, or a cluster's
startup nodes), the timeout, the TTL and the backoff.

RedisTier and ClusterLink check their options here, and the sidecar checks a Redis
backend's extra config here at start-up, before any pool registers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from urllib.parse import urlsplit


def check_options(
    url: object,
    timeout_s: object,
    ttl_s: object,
    backoff_initial_s: object,
    backoff_max_s: object,
    cluster: object = False,
) -> None:
    """Raise ValueError naming the first bad RedisTier option (also used to check a
    sidecar's extra config at start-up, before any pool registers)."""
    if not isinstance(cluster, bool):
        raise ValueError(f"redis cluster must be true or false, got {cluster!r}")
    if cluster:
        split_urls(url)  # type: ignore[arg-type]
    elif not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {url!r}")
    named = {"timeout_s": timeout_s, "backoff_initial_s": backoff_initial_s, "backoff_max_s": backoff_max_s}
    if ttl_s is not None:
        named["ttl_s"] = ttl_s
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if backoff_max_s < backoff_initial_s:  # type: ignore[operator]
        raise ValueError(f"backoff_max_s {backoff_max_s} is below backoff_initial_s {backoff_initial_s}")


def split_urls(url: str | Sequence[str]) -> list[str]:
    """The startup nodes' URLs: one URL, a comma-separated string, or a list. Raises
    ValueError for an empty list or a URL a cluster cannot use."""
    urls = [u.strip() for u in url.split(",")] if isinstance(url, str) else list(url)
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError(f"redis cluster url must be a URL or a list of URLs, got {url!r}")
    for u in urls:
        if not u.startswith(("redis://", "rediss://")):
            raise ValueError(f"redis cluster url must start with redis:// or rediss:// (no unix sockets), got {u!r}")
        parts = urlsplit(u)
        if not parts.hostname or parts.path not in ("", "/", "/0"):
            raise ValueError(f"redis cluster url needs host:port and no database but 0, got {u!r}")
    return urls
