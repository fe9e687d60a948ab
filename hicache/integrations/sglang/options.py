"""The adapter's keys in SGLang's --hicache-storage-backend-extra-config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.integrations.options import adapter_options

FP8_SETTING_NAMES = ("fp8_e4m3", "fp8_e5m2")  # SGLang's --kv-cache-dtype names of the fp8 formats
COPY_VALUES = ("auto", "direct", "engine", "staging")  # "staging": the former name of "engine"

# Keys SGLang itself reads from the same JSON (loader, controller, allocator); passed over.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "allocator",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
        "file_storage_path",
    }
)


@dataclass(frozen=True)
class Options:
    """target: the sidecar ("unix:///path", "/path" or "host:port"; default $HICACHE_SOCKET,
    else the server's default socket). token: its --token (default $HICACHE_TOKEN).
    namespace: the tenant. model_id: the stored pages' model identity (default SGLang's
    model_name). model_config: an HF config.json for the layer ids and a cross-check (default
    <model_name>/config.json when that exists). staging_pages: the scratch pages flat pages
    (SGLang without interface_v1) are copied through, per batch. timeout_s: each call's
    deadline, and how long start-up waits for the sidecar. copy: who copies between SGLang's
    host pool and the sidecar's (one copy either way; see link.py): "auto" (direct when
    SGLang's host pool is in memfds, "allocator": "shm", and the sidecar is on a Unix socket;
    else engine), "direct" (the sidecar maps SGLang's memfds; refuse to start otherwise),
    "engine" (this process maps the sidecar's host pool and copies), or "staging", the
    former name of "engine" (it once copied through a staging pool, two copies each way).
    kv_cache_dtype: which fp8 SGLang's uint8 KV cache holds ("fp8_e4m3" or "fp8_e5m2", as
    its --kv-cache-dtype; default: read from SGLang's runtime settings)."""

    target: str
    token: str | None = None
    namespace: str = ""
    model_id: str | None = None
    model_config: str | None = None
    staging_pages: int = 128
    timeout_s: float = 10.0
    copy: str = "auto"
    kv_cache_dtype: str | None = None

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> Options:
        """Raises ValueError naming an unknown key (listing the accepted ones) or a bad value."""
        extra = dict(extra or {})
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - fields - SGLANG_KEYS)
        if unknown:
            raise ValueError(
                f"unknown hicache key(s) {unknown} in --hicache-storage-backend-extra-config; "
                f"hicache accepts {sorted(fields)} (besides SGLang's own {sorted(SGLANG_KEYS)})"
            )
        mine = adapter_options(extra, fields, "extra config")
        pages = mine.get("staging_pages", 128)
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
            raise ValueError(f"extra config 'staging_pages' must be an int >= 1, got {pages!r}")
        if mine.get("copy", "auto") not in COPY_VALUES:
            raise ValueError(f"extra config 'copy' must be one of {list(COPY_VALUES)}, got {mine['copy']!r}")
        fp8 = mine.get("kv_cache_dtype")
        if fp8 is not None and fp8 not in FP8_SETTING_NAMES:
            raise ValueError(f"extra config 'kv_cache_dtype' must be one of {list(FP8_SETTING_NAMES)}, got {fp8!r}")
        return cls(**mine)
