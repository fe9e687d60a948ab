"""hicache as a vLLM KV offloading backend (tested with vLLM 0.33.0):

    --kv-transfer-config '{"kv_connector":"HiCacheConnector",
      "kv_connector_module_path":"hicache.integrations.vllm","kv_role":"kv_both",
      "kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"target":"unix:///run/hicache/hicache.sock"}}'

HiCacheConnector is vLLM's OffloadingConnector with hicache's spec, and reports a load the
sidecar could not serve to vLLM's scheduler (connector.py). vLLM's own OffloadingConnector
with "spec_name":"HiCacheOffloadingSpec","spec_module_path":"hicache.integrations.vllm" works
too, but a failed load then stops the worker.

Importing this package imports vLLM; without it (or with a vLLM whose offloading interface
differs) the import fails with an ImportError that says what to install.
"""

from __future__ import annotations

import logging
from importlib import metadata

TESTED = "0.33.0"


def _check_vllm() -> None:
    fix = f"install vLLM {TESTED} (`make vllm-env` builds .venv-vllm from requirements-vllm.txt)"
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise ImportError(f"hicache.integrations.vllm needs vLLM: {fix}") from None
    try:
        from vllm.v1.kv_offload import base
    except ImportError as exc:
        raise ImportError(
            f"vLLM {version} is installed but its offloading interface does not import ({exc}): {fix}"
        ) from None
    needed = ("OffloadingSpec", "OffloadingManager", "OffloadingWorker", "CanonicalKVCaches", "GPULoadStoreSpec")
    missing = [n for n in needed if not hasattr(base, n)]
    if missing:
        raise ImportError(f"vLLM {version} lacks {missing} of the offloading interface hicache was built for: {fix}")
    if version != TESTED:
        logging.getLogger("hicache.integrations.vllm").warning(
            "vLLM %s: hicache's adapter is tested with %s; its offloading interface imports, so it is used",
            version,
            TESTED,
        )


_check_vllm()

from hicache.integrations.vllm.connector import HiCacheConnector  # noqa: E402
from hicache.integrations.vllm.manager import HiCacheLoadStoreSpec, HiCacheOffloadingManager  # noqa: E402
from hicache.integrations.vllm.spec import HiCacheOffloadingSpec  # noqa: E402
from hicache.integrations.vllm.worker import HiCacheOffloadingWorker  # noqa: E402

__all__ = [
    "TESTED",
    "HiCacheConnector",
    "HiCacheLoadStoreSpec",
    "HiCacheOffloadingManager",
    "HiCacheOffloadingSpec",
    "HiCacheOffloadingWorker",
]
