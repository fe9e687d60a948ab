"""HiCacheConnector: vLLM's OffloadingConnector over hicache, with a path for failed loads.

vLLM's OffloadingConnector (0.32 and 0.33) asserts that every transfer job succeeds, so a load the
sidecar cannot serve (it died, or restarted, between the lookup and the load) kills the
worker. vLLM's scheduler does have a path for it, which that connector does not use: a
request waiting on a load that failed is reported in `failed_recving`, and the blocks of a
load that ran within the step (a "sync" load) in `get_block_ids_with_load_errors()`; vLLM
then recomputes them or fails the request, as its `kv_load_failure_policy` says. This
connector reports failed loads that way, has the failed chunks answer MISS for retry_s (so
a recomputed request does not load them again), and is otherwise vLLM's own:

    --kv-transfer-config '{"kv_connector":"HiCacheConnector",
      "kv_connector_module_path":"hicache.integrations.vllm","kv_role":"kv_both",
      "kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"target":"unix:///run/hicache/hicache.sock"}}'

Block ids are only unique within a KV-cache group, so vLLM's scheduler stops on block-level
failures for models of several groups; such a model may not turn on sync loads
(sync_load_budget_bytes, off by default), and its failed loads, all asynchronous, are
reported per request, which vLLM accepts for any model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.outputs import KVConnectorOutput

from hicache.integrations.vllm import compat
from hicache.integrations.vllm.manager import HiCacheOffloadingManager
from hicache.integrations.vllm.worker import HiCacheOffloadingWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger("hicache.integrations.vllm")
SPEC = {"spec_name": "HiCacheOffloadingSpec", "spec_module_path": "hicache.integrations.vllm"}


class HiCacheConnector(OffloadingConnector):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        for key, value in SPEC.items():
            if extra.setdefault(key, value) != value:
                raise ValueError(
                    f"kv_connector_extra_config {key}={extra[key]!r}: HiCacheConnector runs hicache's own "
                    f"offloading spec ({value!r}); leave {key} out, or use vLLM's OffloadingConnector"
                )
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if not compat.SYNC_LOADS and int(extra.get("sync_load_budget_bytes") or 0) > 0:
            raise ValueError(
                f"kv_connector_extra_config sync_load_budget_bytes={extra['sync_load_budget_bytes']!r}: vLLM "
                f"{compat.VERSION} has no sync loads (vLLM 0.33 added them); leave sync_load_budget_bytes out"
            )
        if groups > 1 and int(extra.get("sync_load_budget_bytes") or 0) > 0:
            raise ValueError(
                f"kv_connector_extra_config sync_load_budget_bytes={extra['sync_load_budget_bytes']!r}: this "
                f"model has {groups} KV-cache groups, for which vLLM cannot take a failed load within the step "
                "(its scheduler stops on block-level failures); leave sync_load_budget_bytes out (0)"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        self._invalid_blocks: set[int] = set()
        policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning(
                "hicache: kv_load_failure_policy is %r, so a request whose load from the sidecar fails ends "
                'with an error; set "kv_load_failure_policy":"recompute" to compute it instead',
                policy,
            )

    @property
    def _hicache_worker(self) -> HiCacheOffloadingWorker:
        assert self.connector_worker is not None, "worker-side call on the scheduler's connector"
        worker = self.connector_worker.worker
        assert isinstance(worker, HiCacheOffloadingWorker), "register_kv_caches has not run"
        return worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if not isinstance(getattr(self.connector_worker, "_load_jobs", None), dict):
            raise ImportError(
                "HiCacheConnector reads which request each load job serves from vLLM's "
                "OffloadingConnectorWorker._load_jobs, which this vLLM lacks: install the vLLM "
                "the adapter supports (hicache.integrations.vllm.SUPPORTED), or use vLLM's "
                "OffloadingConnector (a failed load then stops the worker)"
            )
        self._hicache_worker.report_failed_loads()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's finished transfers, plus the requests whose load failed (they are in
        finished_recving too, as vLLM asks); the blocks of failed sync loads go to
        get_block_ids_with_load_errors() in the same step."""
        assert self.connector_worker is not None
        waiting_on = dict(self.connector_worker._load_jobs)  # job id -> request id (None: a 0.33 sync load)
        sending, recving = self.get_finished(finished_req_ids)
        failed: set[str] = set()
        for job_id, blocks in self._hicache_worker.take_failed_loads().items():
            req_id = waiting_on.get(job_id)
            if req_id is None:
                self._invalid_blocks.update(blocks)
            else:
                failed.add(req_id)
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks, self._invalid_blocks = self._invalid_blocks, set()
        return blocks

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: the chunks of a failed load answer MISS for retry_s (the lookup
        answers reused for lookup_ttl_s may be what failed), so a recomputed request does
        not load them again; after a failed sync load, whose request is not known here,
        every lookup does."""
        failed, invalid = connector_output.failed_recving, connector_output.invalid_block_ids
        if not (failed or invalid):
            super().update_connector_output(connector_output)
            return
        assert self.connector_scheduler is not None
        manager = self.connector_scheduler.manager
        assert isinstance(manager, HiCacheOffloadingManager)
        with manager.lock:  # before vLLM completes the loads (and they are forgotten)
            keys = manager.loading(failed or ())
        super().update_connector_output(connector_output)
        with manager.lock:
            manager.load_failed(None if invalid else keys)
