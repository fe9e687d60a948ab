"""hicache as SGLang's HiCache storage backend (tested with SGLang 0.5.23):

    --enable-hierarchical-cache --hicache-mem-layout page_first
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"hicache","module_path":"hicache.integrations.sglang",
      "class_name":"HiCacheSidecarStorage","interface_v1":1,"target":"unix:///run/hicache/hicache.sock"}'

Importing this package imports SGLang; without it (or with an SGLang whose storage interface
differs) the import fails with an ImportError that says what to install.
"""

from __future__ import annotations

import logging
from importlib import metadata

TESTED = "0.5.23"


def _check_sglang() -> None:
    fix = f"install SGLang {TESTED} (`make sglang-env` builds .venv-sglang from requirements-sglang.txt)"
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise ImportError(f"hicache.integrations.sglang needs SGLang: {fix}") from None
    try:
        from sglang.srt.mem_cache import hicache_storage
    except ImportError as exc:
        raise ImportError(
            f"SGLang {version} is installed but its storage interface does not import ({exc}): {fix}"
        ) from None
    missing = [
        n
        for n in ("HiCacheStorage", "HiCacheStorageConfig", "PoolTransfer", "PoolTransferResult")
        if not hasattr(hicache_storage, n)
    ]
    needed = ("batch_get_v1", "batch_set_v1", "batch_exists", "batch_exists_v2", "register_mem_host_pool_v2")
    missing += [n for n in needed if not hasattr(getattr(hicache_storage, "HiCacheStorage", None), n)]
    if missing:
        raise ImportError(f"SGLang {version} lacks {missing} of the storage interface hicache was built for: {fix}")
    if version != TESTED:
        logging.getLogger("hicache.integrations.sglang").warning(
            "SGLang %s: hicache's adapter is tested with %s; its storage interface imports, so it is used",
            version,
            TESTED,
        )


_check_sglang()

from hicache.integrations.sglang.backend import HiCacheSidecarStorage  # noqa: E402

__all__ = ["TESTED", "HiCacheSidecarStorage"]
