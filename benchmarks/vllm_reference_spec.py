"""A measuring stick for benchmarks/engines.py, not product: a vLLM offloading spec whose
offloaded blocks live in the vLLM worker process itself and are copied there, with no other
process involved. vLLM's own CPUOffloadingSpec refuses the CPU platform ("CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs"), so this keeps its scheduler side
(CPUOffloadingManager: LRU over `cpu_bytes_to_use` of chunks) and replaces the worker with
one that copies synchronously between vLLM's blocks and a host buffer per KV tensor.

Loaded through vLLM's OffloadingConnector:
    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "ReferenceOffloadingSpec",
        "spec_module_path": "vllm_reference_spec", "cpu_bytes_to_use": N}}
with benchmarks/ on the server's PYTHONPATH. One block per chunk only (vLLM's default
blocks_per_chunk of 1), one KV-cache group, no tensor parallelism: what the benchmark runs.
"""

from __future__ import annotations

import time

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class ReferenceWorker(OffloadingWorker):
    """Copies whole blocks between vLLM's KV tensors (int8 [num_blocks, page_bytes] each)
    and one host buffer per tensor ([num_chunks, page_bytes]), inside submit_*."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int):
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.host = [torch.empty((num_chunks, *t.shape[1:]), dtype=t.dtype) for t in self.tensors]
        self.finished: list[TransferResult] = []

    def _copy(self, job_id: int, blocks: GPULoadStoreSpec, chunks: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(chunks, CPULoadStoreSpec)
        block_ids = torch.from_numpy(blocks.block_ids).long()
        chunk_ids = torch.from_numpy(chunks.block_ids).long()
        if len(block_ids) != len(chunk_ids):
            raise ValueError(f"one block per chunk only: {len(block_ids)} blocks, {len(chunk_ids)} chunks")
        start, size = time.perf_counter(), 0
        for device, host in zip(self.tensors, self.host, strict=True):
            if store:
                host.index_copy_(0, chunk_ids, device.index_select(0, block_ids))
            else:
                device.index_copy_(0, block_ids, host.index_select(0, chunk_ids))
            size += len(block_ids) * device[0].numel() * device.element_size()
        self.finished.append(TransferResult(job_id, True, size, time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside its submit_*


class ReferenceOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec's manager, ReferenceWorker as its worker (any platform)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.blocks_per_chunk != 1 or len(kv_caches.group_data_refs) != 1:
            raise ValueError(
                f"the reference spec copies one block per chunk of one KV group: blocks_per_chunk "
                f"{self.blocks_per_chunk}, {len(kv_caches.group_data_refs)} groups"
            )
        if not hasattr(self, "_reference_worker"):
            self._reference_worker = ReferenceWorker(kv_caches, self.num_chunks)
        return self._reference_worker
