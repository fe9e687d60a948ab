"""HiCacheOffloadingWorker: one vLLM rank's KV cache, registered with the sidecar.

Each KV-cache group becomes one sidecar pool whose pages are vLLM's blocks, mapped from
vLLM's own allocation (its fd goes to the sidecar over the Unix socket), so an Offload or a
Reload copies straight between vLLM's blocks and the sidecar's host pool. Registration runs
when vLLM hands over its KV caches, and any error there stops vLLM's start-up. Transfers run
on three threads (stores, loads, expedited loads) so that submitting never blocks vLLM's
step, and an expedited load (which vLLM waits for within the step) never queues behind
regular loads. Under HiCacheConnector (connector.py) a failed load is reported to vLLM's
scheduler instead of as a failed job, which vLLM's own connector asserts against.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
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
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.geometry import KVGeometry
from hicache.integrations.vllm import rendezvous
from hicache.integrations.vllm.batches import BATCH
from hicache.integrations.vllm.keys import KEY_HASH, GroupMoves, plan_moves
from hicache.integrations.vllm.load_store_spec import HiCacheLoadStoreSpec
from hicache.integrations.vllm.memory import GroupMemory, group_memory
from hicache.integrations.vllm.options import Options

log = logging.getLogger("hicache.integrations.vllm")
LOADED = (KeyStatus.LOADED, KeyStatus.LOADED_FROM_STORAGE)
KEPT = (KeyStatus.STORED, KeyStatus.DEDUPLICATED)


class NotLinked(ConnectionError):
    """A transfer on a group that has no sidecar pool: the sidecar was down when it registered."""


@dataclass
class GroupLink:
    """One group's sidecar pool."""

    name: str
    geometry: KVGeometry
    memory: GroupMemory
    pool_id: str = ""  # "" while not registered (the sidecar was down)
    secret: str = field(default="", repr=False)
    announced: bool = False  # its copy path has been logged


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
        self._lock = threading.Lock()
        self._down = False  # a call failed for want of the sidecar; it was logged once
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        try:
            for g, (refs, (geometry, packed, name)) in enumerate(
                zip(kv_caches.group_data_refs, geometries, strict=True)
            ):
                views = [kv_caches.tensors[r.tensor_idx].tensor for r in refs]
                self.links.append(GroupLink(name, geometry, group_memory(views, g, packed)))
            try:
                for link in self.links:
                    self._register(link)
                self._publish()
            except (HiCacheRpcError, OSError) as exc:
                if not _sidecar_down(exc):
                    raise
                self._went_down(exc, starting=True)
        except BaseException:
            self.shutdown()
            raise
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="hicache-store")
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="hicache-load")
        self._expedited = ThreadPoolExecutor(1, thread_name_prefix="hicache-load-now")
        self._jobs: dict[int, Future[tuple[TransferResult, list[int]]]] = {}
        self._reports_failed_loads = False
        self._failed_loads: dict[int, list[int]] = {}  # job id -> GPU blocks it did not load
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="hicache-watchdog")
        self._watchdog.start()

    # ---- registration --------------------------------------------------------------------------
    def _register(self, link: GroupLink, *, wait: bool = True) -> None:
        """Register one group's memory: vLLM's file (its fd) or CUDA allocation, which the
        sidecar maps; or memory it cannot map (vLLM's CPU worker allocates its KV cache
        privately), registered with the copy path "engine": this worker maps the sidecar's
        host pool and copies itself. That choice is logged once, as a warning, since vLLM
        shows only its own loggers' INFO lines. `wait`: wait up to timeout_s for a sidecar
        that is not up (start-up); else a sidecar that is down fails at once. Raises
        HiCacheRpcError or OSError."""
        p, m = self.config.parallel, link.memory
        common: dict[str, Any] = dict(
            namespace=self.options.namespace,
            model_id=self.model_id,
            group=link.name,
            key_hash=KEY_HASH,
            tp_rank=p.rank,
            tp_size=p.world_size,
        )
        if m.private is not None:
            info = self.client.register_engine_copy(
                link.geometry, m.num_blocks, m.private, device_layout=m.layout, wait=wait, **common
            )
            if not link.announced:  # the first registration, not one after a sidecar restart
                log.warning(
                    "hicache: vLLM's KV cache (group %s) is in private memory: this worker copies it (copy path 'engine')",
                    link.name,
                )
        else:
            (fd_id,) = self.client.send_fds([m.fd]) if m.cuda is None else ("",)
            info = self.client.register_memory(
                link.geometry,
                m.num_blocks,
                m.handle(fd_id),
                device_layout=m.layout,
                cuda_device=m.cuda_device,
                wait=wait,
                **common,
            )
        link.pool_id, link.secret, link.announced = info.pool_id, info.secret, True

    def _publish(self) -> None:
        pools = {g: (link.pool_id, link.secret) for g, link in enumerate(self.links)}
        rendezvous.publish(self.options.meeting_dir, self.config.engine_id, self.config.parallel.rank, pools)

    def _call_pool(self, link: GroupLink, fn: str, keys: list[bytes], blocks: list[int]) -> tuple[KeyStatus, ...]:
        """client.offload/reload on the link's pool; a pool the sidecar forgot (it restarted)
        is registered again, published, and the call made once more. Raises HiCacheRpcError,
        or NotLinked while the link has no pool and the sidecar is still down."""
        pool_id = link.pool_id
        if pool_id:
            try:
                statuses = getattr(self.client, fn)(keys, blocks, pool=pool_id).statuses
                self._went_up()
                return statuses  # type: ignore[no-any-return]
            except HiCacheRpcError as exc:
                if not _forgotten(exc):
                    raise
        if not self._relink(link, pool_id):
            raise NotLinked(f"group {link.name} is not registered with the sidecar (it was down)")
        return getattr(self.client, fn)(keys, blocks, pool=link.pool_id).statuses  # type: ignore[no-any-return]

    def _relink(self, link: GroupLink, stale: str) -> bool:
        """Register the link again in place of `stale` (its pool id the sidecar forgot, or ""),
        unless another thread did meanwhile, and publish once every link has a pool. Fails at
        once (False) while the sidecar is down; other errors raise."""
        with self._lock:
            if link.pool_id != stale:
                return bool(link.pool_id)
            if stale:
                self.client.forget(stale)  # or the client would keep its secret and renew its lease
                link.pool_id = link.secret = ""
            try:
                self._register(link, wait=False)
            except (HiCacheRpcError, OSError) as exc:
                if not _sidecar_down(exc):
                    raise
                self._went_down(exc)
                return False
            if all(other.pool_id for other in self.links):
                self._publish()
            was = f"lost pool {stale} (restarted?)" if stale else "answers"
            log.warning("hicache sidecar %s; group %s registered as pool %s", was, link.name, link.pool_id)
            self._went_up()
            return True

    def _watch(self) -> None:
        """Every retry_s: register the links that have no pool (the sidecar was down), or
        whose pool the sidecar forgot (it restarted), so that lookups find this worker's pools
        again even when vLLM sends no transfer (its scheduler refuses stores while lookups fail)."""
        while not self._stop.wait(self.options.retry_s):
            for link in self.links:
                pool_id = link.pool_id
                try:
                    if pool_id:
                        self.client.keep_alive(pool_id)
                        continue
                except HiCacheRpcError as exc:
                    if not _forgotten(exc):
                        if _sidecar_down(exc):
                            self._went_down(exc)
                        continue
                except KeyError:  # another thread is registering it again
                    continue
                try:
                    self._relink(link, pool_id)
                except Exception as exc:
                    log.warning("hicache: registering group %s with the sidecar failed: %s", link.name, exc)

    def _went_down(self, exc: Exception, *, starting: bool = False) -> None:
        """Log the first failure of an outage (one line); later ones only at debug level."""
        if self._down:
            log.debug("hicache sidecar still down: %s", exc)
            return
        self._down = True
        if starting:
            log.warning(
                "hicache: the sidecar %s does not answer (%s): vLLM serves without it, and this worker registers "
                "when it answers (asked every %.0f s)",
                self.options.target,
                _short(exc),
                self.options.retry_s,
            )
        else:
            log.warning(
                "hicache sidecar %s failed (%s): serving without it until it answers", self.options.target, _short(exc)
            )

    def _went_up(self) -> None:
        self._down = False

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
                    statuses = self._call_pool(link, "offload" if store else "reload", keys, blocks)
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
            if _sidecar_down(exc):
                self._went_down(exc)
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
        self._stop.set()
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


def _sidecar_down(exc: BaseException) -> bool:
    """Whether `exc` says the sidecar is not there (down, restarting, not started yet), as
    opposed to refusing this worker (geometry, token, ...)."""
    if isinstance(exc, HiCacheRpcError):
        return exc.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    return isinstance(exc, OSError)  # the fd socket (<socket>.fd) is not there


def _forgotten(exc: HiCacheRpcError) -> bool:
    """A call named a pool the sidecar does not know: it restarted, or the lease ran out."""
    return exc.code.name == "NOT_FOUND" and "pool" in exc.details


def _short(exc: Exception) -> str:
    text = exc.details if isinstance(exc, HiCacheRpcError) else str(exc)
    name = exc.code.name if isinstance(exc, HiCacheRpcError) else type(exc).__name__
    return f"{name}: {text.splitlines()[0] if text else ''}"[:200]


def _stream_event() -> Any:
    """A CUDA event recorded on vLLM's current stream (GPU hosts only; not run on CI)."""
    import torch

    event = torch.cuda.Event()
    event.record()
    return event
