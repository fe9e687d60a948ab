"""HiCacheConnector: vLLM's OffloadingConnector over hicache, with a path for failed loads.

vLLM 0.33's OffloadingConnector asserts that every transfer job succeeds, so a load the
sidecar cannot serve (it died, or restarted, between the lookup and the load) kills the
worker. vLLM's scheduler does have a path for it, which that connector does not use: a
request waiting on a load that failed is reported in `failed_recving`, and the blocks of a
load that ran within the step (a "sync" load) in `get_block_ids_with_load_errors()`; vLLM
then recomputes them or fails the request, as its `kv_load_failure_policy` says. This
connector reports failed loads that way, drops the scheduler's reused lookup answers after
one (so a recomputed request does not retry the load that failed), and is otherwise vLLM's
own:

    --kv-transfer-config '{"kv_connector":"HiCacheConnector",
      "kv_connector_module_path":"hicache.integrations.vllm","kv_role":"kv_both",
      "kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"target":"unix:///run/hicache/hicache.sock"}}'

Limit (vLLM's): block ids are only unique within a KV-cache group, so vLLM's scheduler
refuses block-level failures for models of several groups (a RuntimeError that stops the
engine, naming the cause). A failed *sync* load of such a model therefore still stops vLLM
rather than compute on wrong KV; failed asynchronous loads are reported per request, which
vLLM accepts for any model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.outputs import KVConnectorOutput

from hicache.integrations.vllm.worker import HiCacheOffloadingWorker

if TYPE_CHECKING:
    import torch

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
        super().__init__(vllm_config, role, kv_cache_config)
        self._invalid_blocks: set[int] = set()

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
                "the adapter is tested with (hicache.integrations.vllm.TESTED), or use vLLM's "
                "OffloadingConnector (a failed load then stops the worker)"
            )
        self._hicache_worker.report_failed_loads()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's finished transfers, plus the requests whose load failed (they are in
        finished_recving too, as vLLM asks); the blocks of failed sync loads go to
        get_block_ids_with_load_errors() in the same step."""
        assert self.connector_worker is not None
        waiting_on = dict(self.connector_worker._load_jobs)  # job id -> request id (None: a sync load)
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
        """Scheduler side: after a failed load, the lookup answers this scheduler reuses
        (lookup_ttl_s) may be what failed, so they are dropped with their pins, and the next
        lookups ask the sidecar again (a down one answers MISS for retry_s); a recomputed
        request does not retry the load that just failed."""
        super().update_connector_output(connector_output)
        if connector_output.failed_recving or connector_output.invalid_block_ids:
            assert self.connector_scheduler is not None
            manager = self.connector_scheduler.manager
            with manager.lock:
                manager.reset_cache()
