"""Build a storage tier from a backend name and its extra-config dict."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache.storage.base import StorageTier, TierIdentity
from hicache.storage.mooncake_options import MooncakeOptions, master_problem

if TYPE_CHECKING:
    from hicache.storage.file import FileTier

BACKENDS = ("file", "redis", "redis-cluster", "mooncake", "none")
_REDIS_OPTIONS = ("url", "timeout_s", "ttl_s", "backoff_initial_s", "backoff_max_s")
# extra-config keys each backend accepts
BACKEND_OPTIONS: dict[str, tuple[str, ...]] = {
    "file": ("dir", "max_bytes", "fsync", "read_threads"),
    "redis": (*_REDIS_OPTIONS, "cluster"),
    "redis-cluster": _REDIS_OPTIONS,  # = "redis" with "cluster": true
    "mooncake": tuple(f.name for f in dataclasses.fields(MooncakeOptions)),
    "none": (),
}


def resolved(backend: str, extra: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The backend and options a name stands for: "redis-cluster" is "redis" with
    {"cluster": true}; a redis config says whether it is a cluster."""
    if backend == "redis-cluster":
        return "redis", {**extra, "cluster": True}
    if backend == "redis":
        return "redis", {"cluster": False, **extra}
    return backend, dict(extra)


DEFAULT_FILE_SHARE = 0.10  # of the disk's free bytes at start-up
DEFAULT_FILE_MAX = 64 << 30


def default_file_cap(directory: str | os.PathLike[str]) -> int:
    """The file tier's size cap when the extra config sets no max_bytes: 10% of the bytes
    free on the folder's disk now, at most 64 GiB (at least one byte)."""
    free = shutil.disk_usage(_existing_ancestor(directory)).free
    return max(1, min(DEFAULT_FILE_MAX, int(free * DEFAULT_FILE_SHARE)))


def _existing_ancestor(directory: str | os.PathLike[str]) -> Path:
    """The folder, or its nearest existing parent: a tier folder may not exist yet, and its
    disk and permissions are those of where it will be created."""
    probe = Path(directory).resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def file_dir_problem(directory: str | os.PathLike[str]) -> str:
    """Why the file tier cannot keep pages in `directory` ("" when it can): the folder is
    created if missing and a file written and removed in it. Never raises."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".hicache-probe-", delete=True)
        probe.close()
    except OSError as exc:
        return f"storage folder {str(directory)!r} cannot hold pages: {exc.strerror or exc}"
    return ""


def default_file_dir() -> Path:
    """$XDG_CACHE_HOME/hicache, else ~/.cache/hicache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache"


def check_extra(backend: str, extra: Mapping[str, Any], also: tuple[str, ...] = ()) -> None:
    """Raise ValueError for an unknown backend, an unknown key, a missing redis url, or a
    bad option value (the tiers' own checks, run without making a tier)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown storage backend {backend!r}; expected one of {list(BACKENDS)}")
    unknown = sorted(set(extra) - set(BACKEND_OPTIONS[backend]))
    if unknown:
        raise ValueError(
            f"unknown extra-config key(s) {unknown} for storage backend {backend!r}; "
            f"accepted: {[*BACKEND_OPTIONS[backend], *also]}"
        )
    if backend.startswith("redis") and not extra.get("url"):
        forms = "redis://host:port, or a list of them" if backend == "redis-cluster" else "redis://... or unix://..."
        raise ValueError(f'storage backend "{backend}" needs "url" in its extra config ({forms})')
    backend, extra = resolved(backend, extra)
    if backend == "mooncake":
        MooncakeOptions.from_extra(extra)
    if backend == "file":
        from hicache.storage import file

        file.check_options(
            extra.get("dir") or default_file_dir(),
            extra.get("max_bytes"),
            extra.get("fsync", file.DEFAULT_FSYNC),
            extra.get("read_threads", file.DEFAULT_READ_THREADS),
        )
    if backend == "redis":
        from hicache.storage import redis

        params = inspect.signature(redis.RedisTier.__init__).parameters  # the tier's own defaults
        options = {name: params[name].default for name in BACKEND_OPTIONS["redis"] if name != "url"}
        options.update((k, v) for k, v in extra.items() if k != "url")
        redis.check_options(extra["url"], **options)


# Live file tiers of this process: two pools of one identity (an engine that registers again
# before its old lease ran out, or two replicas of one model) share the folder's index and cap.
_FILE_TIERS: weakref.WeakValueDictionary[tuple[Path, TierIdentity, Any, Any, Any], FileTier] = (
    weakref.WeakValueDictionary()
)
_FILE_TIERS_LOCK = threading.Lock()


def make_tier(backend: str, extra: Mapping[str, Any], identity: TierIdentity) -> StorageTier:
    """A tier of `backend` ("file", "redis", "mooncake" or "none") for `identity`; a file tier for a
    folder and identity that is already open in this process is shared, not opened twice
    (each caller closes it once; the last close releases it).

    extra for file: {"dir": PATH, "max_bytes": N, "fsync": true | false | "batch", "read_threads": N};
    for redis: {"url": ...,
    "cluster": bool, "timeout_s": ..., "ttl_s": ..., "backoff_initial_s": ...,
    "backoff_max_s": ...} (redis-cluster: the same without "cluster"); for mooncake:
    MooncakeOptions' fields, "master_server_address" required.
    Raises ValueError naming a bad backend, key or value.
    """
    check_extra(backend, extra)
    backend, extra = resolved(backend, extra)
    if backend == "file":
        from hicache.storage.file import DEFAULT_FSYNC, DEFAULT_READ_THREADS, FileTier

        directory = Path(extra.get("dir") or default_file_dir()).resolve()
        max_bytes, fsync = extra.get("max_bytes"), extra.get("fsync", DEFAULT_FSYNC)
        readers = extra.get("read_threads", DEFAULT_READ_THREADS)
        with _FILE_TIERS_LOCK:  # one FileTier (one index, one cap) per folder and identity
            shared = (directory, identity, max_bytes, fsync, readers)
            tier = _FILE_TIERS.get(shared)
            if tier is None or not tier.share():  # none yet, or its last user closed it
                tier = FileTier(identity, directory, max_bytes=max_bytes, fsync=fsync, read_threads=readers)
                _FILE_TIERS[shared] = tier
            return tier
    if backend == "redis":
        from hicache.storage.redis import RedisTier

        opts = {k: v for k, v in extra.items() if k != "url"}
        return RedisTier(identity, extra["url"], **opts)
    if backend == "mooncake":
        from hicache.storage.mooncake import MooncakeTier

        return MooncakeTier(identity, MooncakeOptions.from_extra(extra))
    from hicache.storage.null import NullTier

    return NullTier(identity)


def backend_reachable(backend: str, extra: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the configured backend can serve before any pool has a tier of it (the
    health service at start-up): (True, "") or (False, why). Redis: a node answers within
    its timeout_s and is (or is not, without "cluster") a cluster node; file: the folder (or
    its nearest existing parent) is writable. Never raises."""
    backend, extra = resolved(backend, extra)
    if backend == "redis":
        answered, why = redis_kind(extra)
        if answered is None:
            return False, why
        mismatch = kind_mismatch(extra, answered)
        return (False, mismatch) if mismatch else (True, "")
    if backend == "mooncake":
        try:
            import mooncake.store  # noqa: F401 - the package and its libibverbs

            problem = master_problem(MooncakeOptions.from_extra(extra))
        except ImportError as exc:
            problem = f"storage backend 'mooncake': {exc} (pip install hicache[mooncake]; apt-get install libibverbs1)"
        except ValueError as exc:
            problem = str(exc)
        return (False, problem) if problem else (True, "")
    if backend == "file":
        probe = _existing_ancestor(extra.get("dir") or default_file_dir())
        if not probe.is_dir() or not os.access(probe, os.W_OK):
            return False, f"storage backend 'file': {probe} is not a writable folder"
    return True, ""


def redis_kind(extra: Mapping[str, Any]) -> tuple[bool | None, str]:
    """(whether the first Redis that answers is a cluster node, "") or (None, why none
    answered), for a resolved redis extra config. Never raises."""
    from hicache.storage.redis_options import split_urls

    try:
        import redis

        urls = split_urls(extra["url"]) if extra.get("cluster") else [extra["url"]]
        timeout = float(extra.get("timeout_s", 1.0))
    except (ImportError, ValueError, TypeError) as exc:
        return None, f"storage backend 'redis': {exc}"
    why = ""
    for url in urls:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.info("cluster").get("cluster_enabled")), ""
        except Exception as exc:  # noqa: BLE001 - any failure is "unreachable"
            why = f"storage backend 'redis' at {url} is unreachable: {type(exc).__name__}: {exc}"
        finally:
            client.close()
    return None, why


def kind_mismatch(extra: Mapping[str, Any], is_cluster: bool) -> str:
    """What is wrong when the config and the server disagree about being a cluster, or ""."""
    url = extra["url"]
    if extra.get("cluster") and not is_cluster:
        return (
            f"storage backend 'redis-cluster' (cluster: true) but {url} is not a cluster node "
            "(cluster_enabled:0): use --hicache-storage-backend redis, or point url at a cluster"
        )
    if not extra.get("cluster") and is_cluster:
        return (
            f"storage backend 'redis' but {url} is a Redis Cluster node (cluster_enabled:1): "
            'use --hicache-storage-backend redis-cluster, or add "cluster": true to the extra config'
        )
    return ""


def check_backend_kind(backend: str, extra: Mapping[str, Any]) -> None:
    """At start-up: raise ValueError when a reachable Redis is a cluster and the config does
    not say so, or the reverse. An unreachable one passes (the health service reports it)."""
    backend, extra = resolved(backend, extra)
    if backend == "redis":
        answered, _ = redis_kind(extra)
        mismatch = "" if answered is None else kind_mismatch(extra, answered)
        if mismatch:
            raise ValueError(mismatch)
