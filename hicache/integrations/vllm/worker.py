"""HiCacheOffloadingWorker: one vLLM rank's KV cache, registered with the sidecar.

Each KV-cache group becomes one sidecar pool whose pages are vLLM's blocks, mapped from
vLLM's own allocation (its fd goes to the sidecar over the Unix socket), so an Offload or a
Reload copies straight between vLLM's blocks and the sidecar's host pool. Registration
(group_links) runs when vLLM hands over its KV caches, and any error there stops vLLM's
start-up. Transfers run on three threads (stores, loads, expedited loads) so that
submitting never blocks vLLM's step, and an expedited load (which vLLM waits for within the
step) never queues behind regular loads. Under HiCacheConnector (connector.py) a failed
load is reported to vLLM's scheduler instead of as a failed job, which vLLM's own connector
asserts against.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from hicache.api import KeyStatus
from hicache.client import HiCacheClient
from hicache.geometry import KVGeometry
from hicache.integrations.vllm import rendezvous
from hicache.integrations.vllm.batches import BATCH
from hicache.integrations.vllm.group_links import GroupLink, GroupLinks, sidecar_down
from hicache.integrations.vllm.keys import GroupMoves, plan_moves
from hicache.integrations.vllm.load_store_spec import HiCacheLoadStoreSpec
from hicache.integrations.vllm.memory import GroupMemory, group_memory
from hicache.integrations.vllm.options import Options

log = logging.getLogger("hicache.integrations.vllm")
LOADED = (KeyStatus.LOADED, KeyStatus.LOADED_FROM_STORAGE)
KEPT = (KeyStatus.STORED, KeyStatus.DEDUPLICATED)


class HiCacheOffloadingWorker(OffloadingWorker):  # type: ignore[misc]
    def __init__(
        self,
        options: Options,
        config: OffloadingConfig,
        kv_caches: CanonicalKVCaches,
        geometries: list[tuple[KVGeometry, int, str]],
        model_id: str,
    ):
        self.options, self.config, self.model_id = options, config, model_id
        self.blocks_per_chunk = config.cache.blocks_per_chunk
        self.client = HiCacheClient(options.target, token=options.token, timeout=options.timeout_s)
        self.links: list[GroupLink] = []
        self._sidecar = GroupLinks(options, config, self.client, model_id, self.links)
        self._watchdog: threading.Thread | None = None
        try:
            for g, (refs, (geometry, packed, name)) in enumerate(
                zip(kv_caches.group_data_refs, geometries, strict=True)
            ):
                views = [kv_caches.tensors[r.tensor_idx].tensor for r in refs]
                self.links.append(GroupLink(name, geometry, group_memory(views, g, packed)))
            self._sidecar.register_all()
        except BaseException:
            self.shutdown()
            raise
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="hicache-store")
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="hicache-load")
        self._expedited = ThreadPoolExecutor(1, thread_name_prefix="hicache-load-now")
        self._jobs: dict[int, Future[tuple[TransferResult, list[int]]]] = {}
        self._reports_failed_loads = False
        self._failed_loads: dict[int, list[int]] = {}  # job id -> GPU blocks it did not load
        self._watchdog = threading.Thread(target=self._sidecar.watch, daemon=True, name="hicache-watchdog")
        self._watchdog.start()

    # ---- transfers -----------------------------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        return self._submit(job_id, dst_spec, src_spec, store=False, expedited=expedited)

    def _submit(
        self, job_id: int, gpu: GPULoadStoreSpec, chunks: LoadStoreSpec, *, store: bool, expedited: bool = False
    ) -> bool:
        if not isinstance(chunks, HiCacheLoadStoreSpec):
            raise TypeError(f"expected a HiCacheLoadStoreSpec, got {type(chunks).__name__}")
        moves = plan_moves(
            chunks.keys, gpu.block_ids.tolist(), gpu.group_sizes, gpu.block_indices, self.blocks_per_chunk
        )
        ready = _stream_event() if any(link.memory.cuda is not None for link in self.links) else None
        pool = self._stores if store else self._expedited if expedited else self._loads
        self._jobs[job_id] = pool.submit(self._run, job_id, moves, store, ready)
        return True

    def _run(
        self, job_id: int, moves: list[GroupMoves], store: bool, ready: Any = None
    ) -> tuple[TransferResult, list[int]]:
        """One job, once vLLM's stream has passed `ready` (a CUDA event recorded at submit:
        the forward that wrote a store's blocks, or the zeroing of a load's); and, for a load,
        the GPU blocks it did not fill. A store always succeeds towards vLLM (vLLM cannot
        take a failed job, and a page the sidecar did not keep is only a later miss); a load
        succeeds only when every page arrived."""
        start, nbytes, missed = time.perf_counter(), 0, []
        answered = [0] * len(moves)  # blocks of each group the sidecar has answered for
        wanted = KEPT if store else LOADED
        try:
            if ready is not None:
                ready.synchronize()
            for n, m in enumerate(moves):
                link = self.links[m.group]
                for i in range(0, len(m.keys), BATCH):
                    keys, blocks = m.keys[i : i + BATCH], m.blocks[i : i + BATCH]
                    statuses = self._sidecar.call_pool(link, "offload" if store else "reload", keys, blocks)
                    bad = [b for b, status in zip(blocks, statuses, strict=True) if status not in wanted]
                    answered[n] = i + len(keys)
                    nbytes += (len(keys) - len(bad)) * link.geometry.page_bytes
                    if bad:
                        missed += bad
                        log.warning(
                            "hicache %s job %d: %d of %d pages not %s",
                            "store" if store else "load",
                            job_id,
                            len(bad),
                            len(keys),
                            "kept" if store else "loaded",
                        )
        except Exception as exc:
            missed += [b for n, m in enumerate(moves) for b in m.blocks[answered[n] :]]
            if sidecar_down(exc):
                self._sidecar.went_down(exc)
            else:
                log.warning("hicache %s job %d failed: %s", "store" if store else "load", job_id, exc)
        if store:
            return TransferResult(job_id, True, nbytes, time.perf_counter() - start), []
        return TransferResult(job_id, not missed, nbytes, time.perf_counter() - start), missed

    def report_failed_loads(self) -> None:
        """From now on a load that missed pages finishes as a success towards vLLM's
        connector, and take_failed_loads() names its blocks (HiCacheConnector reports them
        to vLLM's scheduler)."""
        self._reports_failed_loads = True

    def take_failed_loads(self) -> dict[int, list[int]]:
        """The loads among the jobs get_finished() has returned since the last call that did
        not fill every GPU block: job id -> those blocks."""
        failed, self._failed_loads = self._failed_loads, {}
        return failed

    def get_finished(self) -> list[TransferResult]:
        out = []
        for job_id in [job_id for job_id, f in self._jobs.items() if f.done()]:
            result, missed = self._jobs.pop(job_id).result()
            if missed and self._reports_failed_loads:
                self._failed_loads[job_id] = missed
                result = TransferResult(job_id, True, result.transfer_size, result.transfer_time)
            out.append(result)
        return out

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            future = self._jobs.get(job_id)
            if future is not None:
                future.exception()  # waits; _run never raises

    def shutdown(self) -> None:
        self._sidecar.stop.set()
        if self._watchdog is not None:
            self._watchdog.join()
        for pool in (getattr(self, name, None) for name in ("_stores", "_loads", "_expedited")):
            if pool is not None:
                pool.shutdown(wait=True)
        rendezvous.withdraw(self.options.meeting_dir, self.config.engine_id, self.config.parallel.rank)
        for link in self.links:
            if link.memory.fd >= 0:
                os.close(link.memory.fd)
                link.memory = GroupMemory(-1, link.memory.nbytes, link.memory.num_blocks, link.memory.layout)
        self.client.close()


def _stream_event() -> Any:
    """A CUDA event recorded on vLLM's current stream (GPU hosts only; not run on CI)."""
    import torch

    event = torch.cuda.Event()
    event.record()
    return event
