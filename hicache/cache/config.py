"""HiCacheConfig: the hierarchy's settings, with the flag names users of SGLang know.

    --hicache-storage-backend file|redis|none        (default file)
    --hicache-write-policy write_through|write_through_selective|write_back
    --hicache-storage-prefetch-policy best_effort|wait_complete|timeout
    --hicache-storage-backend-extra-config JSON       file: {"dir", "max_bytes", "fsync",
        "read_threads"}; redis: {"url", "timeout_s", "ttl_s", "backoff_initial_s", "backoff_max_s"}; any
        backend: {"prefetch_timeout_base_s", "prefetch_timeout_per_ki_token_s",
        "prefetch_timeout_max_s"} for the timeout policy
    --hicache-size GB    host memory of the whole sidecar in GB, shared by its pools
                         (hicache.sidecar.host_budget); 0: size each pool by --hicache-ratio
    --hicache-ratio R    host pool pages = R x device pool pages
    --hicache-tier-secret-file PATH, or HICACHE_TIER_SECRET (--hicache-tier-secret)
                         a secret that every stored page carries a MAC of (page_format)

add_arguments(parser) adds them to any argparse parser; from_args(namespace) reads them.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hicache.cache.policies import (
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    PrefetchTimeout,
    check_prefetch_policy,
    check_write_policy,
)
from hicache.cache.results import PagePool
from hicache.cache.tiering import HierarchicalCache
from hicache.geometry import KVGeometry
from hicache.storage.base import StorageTier, TierIdentity
from hicache.storage.factory import BACKENDS, check_extra, default_file_cap, default_file_dir, make_tier

_TIMEOUT_KEYS = {
    "prefetch_timeout_base_s": "base_s",
    "prefetch_timeout_per_ki_token_s": "per_ki_token_s",
    "prefetch_timeout_max_s": "max_s",
    # SGLang's names for the same seconds, so that an SGLang extra config works unchanged
    "prefetch_timeout_base": "base_s",
    "prefetch_timeout_per_ki_token": "per_ki_token_s",
}
# read by SGLang's controller (tokens below which it does not prefetch); the sidecar has no use for it
_SGLANG_ONLY = ("prefetch_threshold",)
HIERARCHY_KEYS: tuple[str, ...] = (*_TIMEOUT_KEYS, *_SGLANG_ONLY)


def parse_extra_config(text: str | None) -> dict[str, Any]:
    """The JSON object in `text` ({} for None or ""), or, as SGLang reads it, in the file
    `text` names after an "@" (@config.json, @config.yaml). Raises ValueError quoting it."""
    if not text:
        return {}
    if text.startswith("@"):
        body = _read_config_file(text[1:])
        value = _yaml(body, text) if text.endswith((".yaml", ".yml")) else _json(body, text)
    else:
        value = _json(text, text)
    if not isinstance(value, dict):
        raise ValueError(f"--hicache-storage-backend-extra-config must be a JSON object, got {text!r}")
    return value


def _json(body: str, source: str) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"--hicache-storage-backend-extra-config is not valid JSON ({e}): {source!r}") from None


def _read_config_file(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--hicache-storage-backend-extra-config @{path}: {e.strerror}") from None


def _yaml(text: str, source: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise ValueError(f"{source}: reading YAML needs PyYAML (pip install pyyaml), or use a .json file") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--hicache-storage-backend-extra-config {source} is not valid YAML: {e}") from None


MIN_SECRET_BYTES = 16


def read_tier_secret(value: str, path: str) -> bytes:
    """The tier secret: `value` (HICACHE_TIER_SECRET) or the contents of the file `path`
    (one trailing newline dropped); b"" for neither. Raises ValueError naming the flag, never
    the secret, for both at once or a file that cannot be read."""
    if value and path:
        raise ValueError("set the tier secret once: HICACHE_TIER_SECRET or --hicache-tier-secret-file, not both")
    if not path:
        return value.encode()
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"--hicache-tier-secret-file {path}: {e.strerror}") from None
    return data[:-1] if data.endswith(b"\n") else data


@dataclass(frozen=True)
class HiCacheConfig:
    """Validated hierarchy settings. Raises ValueError naming a bad value."""

    storage_backend: str = "file"
    write_policy: str = "write_through"
    prefetch_policy: str = "best_effort"
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    size_gb: float = 0.0
    ratio: float = 2.0
    tier_secret: bytes = field(default=b"", repr=False)  # b"": stored pages carry no MAC

    def __post_init__(self) -> None:
        check_write_policy(self.write_policy)
        check_prefetch_policy(self.prefetch_policy)
        check_extra(self.storage_backend, self.storage_extra, also=HIERARCHY_KEYS)
        for key, value in self.extra_config.items():
            if key in _TIMEOUT_KEYS and isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--hicache-storage-backend-extra-config {key} must be finite, got {value!r}")
        self.prefetch_timeout  # noqa: B018 - validates the timeout keys
        for name, flag in (("size_gb", "--hicache-size"), ("ratio", "--hicache-ratio")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"hicache {name} must be a number >= 0, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number, got {value!r}")
        if not isinstance(self.tier_secret, bytes) or 0 < len(self.tier_secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the tier secret must be at least {MIN_SECRET_BYTES} bytes (its value is not shown)")
        if self.size_gb == 0 and self.ratio <= 0:
            raise ValueError(f"hicache ratio must be > 0 when size is 0, got {self.ratio}")

    def with_file_cap(self) -> HiCacheConfig:
        """This config, with the file tier's default cap (default_file_cap) written in when
        the backend is "file" and the extra config sets no max_bytes."""
        if self.storage_backend != "file" or self.extra_config.get("max_bytes") is not None:
            return self
        folder = self.extra_config.get("dir") or default_file_dir()
        return replace(self, extra_config={**self.extra_config, "max_bytes": default_file_cap(folder)})

    @property
    def storage_extra(self) -> dict[str, Any]:
        """The extra config meant for the backend (without the prefetch timeout keys)."""
        return {k: v for k, v in self.extra_config.items() if k not in HIERARCHY_KEYS}

    @property
    def prefetch_timeout(self) -> PrefetchTimeout:
        return PrefetchTimeout(**{_TIMEOUT_KEYS[k]: v for k, v in self.extra_config.items() if k in _TIMEOUT_KEYS})

    # ---- argparse -----------------------------------------------------------------------------
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the --hicache-* flags. Values are validated by from_args, not by argparse,
        so one error type (ValueError naming the value) covers flags and code alike."""
        d = HiCacheConfig()
        g = parser.add_argument_group("hicache hierarchy")
        g.add_argument("--hicache-storage-backend", default=d.storage_backend, help=f"one of {', '.join(BACKENDS)}")
        g.add_argument("--hicache-write-policy", default=d.write_policy, help=f"one of {', '.join(WRITE_POLICIES)}")
        g.add_argument(
            "--hicache-storage-prefetch-policy",
            default=d.prefetch_policy,
            help=f"one of {', '.join(PREFETCH_POLICIES)}",
        )
        g.add_argument(
            "--hicache-storage-backend-extra-config", default="", help="a JSON object; see hicache.cache.config"
        )
        g.add_argument(
            "--hicache-size",
            type=float,
            default=d.size_gb,
            help="host memory GB of the whole sidecar, split among its pools (0: each pool by --hicache-ratio)",
        )
        g.add_argument("--hicache-ratio", type=float, default=d.ratio, help="host pages per device page")
        g.add_argument(
            "--hicache-tier-secret-file",
            default="",
            help="a file holding the tier secret: stored pages carry its MAC, and pages without a valid one are misses",
        )
        g.add_argument(
            "--hicache-tier-secret",
            default="",
            help="the tier secret itself; set it in the environment, as a command line is visible in ps",
        )

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> HiCacheConfig:
        return cls(
            storage_backend=ns.hicache_storage_backend,
            write_policy=ns.hicache_write_policy,
            prefetch_policy=ns.hicache_storage_prefetch_policy,
            extra_config=parse_extra_config(ns.hicache_storage_backend_extra_config),
            size_gb=ns.hicache_size,
            ratio=ns.hicache_ratio,
            tier_secret=read_tier_secret(ns.hicache_tier_secret, ns.hicache_tier_secret_file),
        )

    # ---- building ---------------------------------------------------------------------------
    def host_pages(self, geometry: KVGeometry, device_pages: int) -> int:
        """Host pool pages of a pool alone: size_gb of pages if set, else ratio x
        device_pages (at least 1). A sidecar splits size_gb among its pools (host_budget)."""
        if self.size_gb > 0:
            return max(1, int(self.size_gb * 1e9) // geometry.page_bytes)
        return max(1, int(self.ratio * device_pages))

    def make_tier(self, geometry: KVGeometry, model_id: str, namespace: str = "") -> StorageTier:
        """The storage tier for pages of `geometry` written by model `model_id`."""
        ident = TierIdentity.for_geometry(geometry, model_id, namespace, self.tier_secret)
        return make_tier(self.storage_backend, self.storage_extra, ident)

    def build(self, pool: PagePool, storage: StorageTier, **kwargs: Any) -> HierarchicalCache:
        """A HierarchicalCache over `pool` and `storage` with these policies."""
        return HierarchicalCache(
            pool,
            storage,
            write_policy=self.write_policy,
            prefetch_policy=self.prefetch_policy,
            prefetch_timeout=self.prefetch_timeout,
            **kwargs,
        )
