"""A load the sidecar cannot serve, through HiCacheConnector: vLLM's scheduler hears of it
(failed_recving for a request waiting on the load, block ids for a load within the step)
instead of the worker failing vLLM's assertion (sync loads exist from vLLM 0.33 on). vLLM's own factory makes the connector
from the documented kv-transfer-config, vLLM's OffloadingConnectorWorker runs the jobs
against a live sidecar, and vLLM's own Scheduler takes the report and recomputes the
request. The model runner between them is played by the test (no model runs here)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_env import require_vllm

require_vllm()

import torch  # noqa: E402
from sidecar_util import start_sidecar  # noqa: E402
from test_vllm_offload import CTX, blocks_of, chunk_keys, layer_names, resolve, store  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, make_offload_key  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm_env import (  # noqa: E402
    FIXTURES,
    Engine,
    attention_spec,
    fill,
    make_engine,
    model_dir,
    sidecar_dir,
    start_connector,
    vllm_config,
)

from hicache.integrations.vllm import HiCacheConnector, HiCacheLoadStoreSpec, compat  # noqa: E402

SYNC = compat.SYNC_LOADS  # vLLM 0.33 runs some loads within the step; 0.32 has none


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def connector_engine(tmp: Path, target: str, **kw: Any) -> Engine:
    vc = vllm_config(model_dir(tmp, "qwen3_8b"), target, hicache_connector=True, **kw)
    eng = make_engine(vc, [(attention_spec(vc), layer_names(vc.model_config.get_num_layers(vc.parallel_config)))])
    fill(eng, seed=1)
    return start_connector(eng)


def step(
    eng: Engine, loads: dict[int, TransferJob], metadata: Any = None
) -> tuple[Any, set[int], dict[int, int], KVConnectorOutput]:
    """One step of vLLM's model runner around the connector: bind the metadata (the
    scheduler's, or one holding `loads`), start the loads, wait for them, then read the
    transfer results, the load errors and the worker metadata, as vLLM's
    KVConnectorModelRunnerMixin does; and the KVConnectorOutput it would send back."""
    conn = eng.kv_connector
    metadata = metadata or OffloadingConnectorMetadata(load_jobs=loads, store_jobs={})
    conn.bind_connector_metadata(metadata)
    conn.start_load_kv(None)
    eng.worker.wait(set(metadata.load_jobs))
    results = conn.get_transfer_results(set())
    invalid = conn.get_block_ids_with_load_errors()
    meta = conn.build_connector_worker_meta()
    conn.clear_connector_metadata()
    output = KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        failed_recving=results.failed_recving,
        invalid_block_ids=invalid,
        kv_connector_worker_meta=meta,
    )
    return results, invalid, dict(meta.completed_jobs) if meta is not None else {}, output


def gpu(blocks: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])


def test_vllms_factory_makes_the_connector_from_the_documented_config() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cli = json.loads(
        '{"kv_connector":"HiCacheConnector","kv_connector_module_path":"hicache.integrations.vllm",'
        '"kv_role":"kv_both","kv_load_failure_policy":"recompute",'
        '"kv_connector_extra_config":{"target":"unix:///run/hicache/hicache.sock"}}'
    )
    assert KVConnectorFactory.get_connector_class(KVTransferConfig(**cli)) is HiCacheConnector


def test_a_load_whose_sidecar_died_is_reported_per_request_and_per_block(tmp_path: Path, sockdir: str) -> None:
    proc, target = start_sidecar(sockdir, config=FIXTURES / "qwen3_8b.json", page_size=16)
    eng = connector_engine(tmp_path, target, timeout_s=30.0, retry_s=30.0)
    manager = eng.spec.get_manager()
    try:
        keys = chunk_keys(2)
        want = blocks_of(eng, [1, 2])
        assert store(eng, manager, keys, [1, 2], job=1).success
        assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
        with manager.lock:
            src = manager.prepare_load(keys, CTX)
        # a load that works reports nothing
        eng.raw.zero_()
        results, invalid, done, _ = step(eng, {2: TransferJob("req-ok", src, gpu([7, 8]))})
        assert (results.finished_recving, results.failed_recving, invalid, done) == ({"req-ok"}, set(), set(), {2: 1})
        assert all(torch.equal(a, b) for a, b in zip(want, blocks_of(eng, [7, 8]), strict=True))
        proc.kill()
        proc.wait(timeout=30)
        # a request waiting on its load: failed (and finished, so vLLM stops waiting on it)
        results, invalid, done, _ = step(eng, {3: TransferJob("req-a", src, gpu([4, 5]))})
        assert (results.finished_recving, results.failed_recving, invalid) == ({"req-a"}, {"req-a"}, set())
        assert done == {3: 1}  # vLLM's scheduler completes the job (and releases the load's pins)
        if SYNC:  # a load its request runs within this step: its blocks, in this step only
            results, invalid, done, _ = step(eng, {4: TransferJob("req-b", src, gpu([9, 10]), sync=True)})
            assert (results.finished_recving, results.failed_recving, invalid, done) == (set(), set(), {9, 10}, {4: 1})
            assert eng.kv_connector.get_block_ids_with_load_errors() == set()
    finally:
        manager.shutdown()
        eng.close()
        proc.kill()
        proc.wait(timeout=30)


def test_only_the_blocks_whose_pages_are_missing_are_reported(tmp_path: Path, sockdir: str) -> None:
    proc, target = start_sidecar(sockdir, config=FIXTURES / "qwen3_8b.json", page_size=16)
    eng = connector_engine(tmp_path, target)
    manager = eng.spec.get_manager()
    try:
        kept, never = chunk_keys(1, seed=1), chunk_keys(1, seed=2)
        assert store(eng, manager, kept, [3], job=1).success
        src = HiCacheLoadStoreSpec(kept + never)  # the second chunk was never stored
        job = TransferJob("req-c", src, gpu([11, 12]), **({"sync": True} if SYNC else {}))
        results, invalid, _, _ = step(eng, {2: job})
        if SYNC:  # the blocks of a sync load
            assert invalid == {12} and results.failed_recving == set()
        else:  # vLLM 0.32: the request of an asynchronous one
            assert invalid == set() and results.failed_recving == {"req-c"}
        assert torch.equal(blocks_of(eng, [11])[0], blocks_of(eng, [3])[0])
    finally:
        manager.shutdown()
        eng.close()
        proc.terminate()
        proc.wait(timeout=60)


def test_sync_loads_are_refused_for_a_model_of_several_groups(tmp_path: Path) -> None:
    """vLLM's scheduler stops on a failed sync load of such a model (block ids are per group)."""
    vc = vllm_config(model_dir(tmp_path, "qwen3_8b"), "unix:///nowhere.sock", hicache_connector=True)
    vc.kv_transfer_config.kv_connector_extra_config["sync_load_budget_bytes"] = 1 << 20
    spec = attention_spec(vc)
    eng = make_engine(vc, [(spec, layer_names(2)), (spec, layer_names(2, [2, 3]))])
    why = "this model has 2 KV-cache groups" if SYNC else "vLLM 0.32.0 has no sync loads"
    with pytest.raises(ValueError, match=f"sync_load_budget_bytes=1048576: {why}"):
        start_connector(eng)


def test_a_policy_that_fails_requests_is_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = vllm_config(model_dir(tmp_path, "qwen3_8b"), "unix:///nowhere.sock", hicache_connector=True)
    vc.kv_transfer_config.kv_load_failure_policy = "fail"
    eng = make_engine(vc, [(attention_spec(vc), layer_names(2))])
    with caplog.at_level("WARNING", logger="hicache.integrations.vllm"):
        HiCacheConnector(vc, KVConnectorRole.SCHEDULER, eng.kv_cache_config).shutdown()
    assert any("kv_load_failure_policy is 'fail'" in r.getMessage() for r in caplog.records)


def test_a_spec_other_than_hicaches_is_refused_naming_the_key(tmp_path: Path) -> None:
    vc = vllm_config(model_dir(tmp_path, "qwen3_8b"), "unix:///nowhere.sock", hicache_connector=True)
    vc.kv_transfer_config.kv_connector_extra_config["spec_name"] = "CPUOffloadingSpec"
    eng = make_engine(vc, [(attention_spec(vc), layer_names(2))])
    with pytest.raises(ValueError, match="spec_name='CPUOffloadingSpec'.*HiCacheConnector runs hicache's own"):
        start_connector(eng)


def scheduled_tokens_after_a_load(eng: Engine, sidecar: Any, *, fault: str) -> int:
    """vLLM's Scheduler (its connector made by vLLM's factory, scheduler role) meets a
    64-token prompt whose four blocks the sidecar holds: it schedules their load; the load
    runs (after killing the sidecar for fault "sidecar-died", with one Reload call failing
    for "reload-failed"); then the tokens it schedules for the request's first forward."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    vc = eng.vllm_config
    vc.cache_config.block_size, vc.cache_config.num_gpu_blocks = 16, eng.kv_cache_config.num_blocks
    sched = Scheduler(vc, eng.kv_cache_config, StructuredOutputManager(vc), block_size=16)
    assert isinstance(sched.connector, HiCacheConnector)
    init_none_hash(sha256)
    req = Request(
        "A",
        list(range(100, 164)),
        SamplingParams(max_tokens=4),
        None,
        block_hasher=get_request_block_hasher(16, sha256),
    )
    keys = [make_offload_key(h, 0) for h in req.block_hashes]
    eng.worker.submit_store(1, gpu([1, 2, 3, 4]), HiCacheLoadStoreSpec(keys))
    eng.worker.wait({1})
    assert [r.success for r in eng.worker.get_finished()] == [True]
    sched.add_request(req)
    nothing = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    try:
        for _ in range(200):  # the first lookups answer RETRY until the lookup thread has asked
            out = sched.schedule()
            assert not out.num_scheduled_tokens
            if out.kv_connector_metadata.load_jobs:
                break
            sched.update_from_output(out, nothing)
            time.sleep(0.02)
        assert out.kv_connector_metadata.load_jobs and req.status.name == "WAITING_FOR_REMOTE_KVS"
        if fault == "sidecar-died":
            sidecar.kill()
            sidecar.wait(timeout=30)
        elif fault == "reload-failed":  # the sidecar stays up and keeps the pages
            real = eng.worker.client.reload

            def fail_once(*args: Any, **kw: Any) -> Any:
                eng.worker.client.reload = real
                raise RuntimeError("injected: the Reload call failed")

            eng.worker.client.reload = fail_once
        *_, output = step(eng, {}, out.kv_connector_metadata)
        sched.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=output))
        for _ in range(200):  # after a failure, one lookup round: the sidecar is asked again
            out = sched.schedule()
            if out.num_scheduled_tokens:
                return int(out.num_scheduled_tokens["A"])
            assert not out.kv_connector_metadata.load_jobs, "the failed load was tried again"
            sched.update_from_output(out, nothing)
            time.sleep(0.02)
        raise AssertionError("request A was never scheduled")
    finally:
        sched.shutdown()


@pytest.mark.parametrize("fault", ["none", "sidecar-died", "reload-failed"])
def test_vllms_scheduler_recomputes_a_request_whose_load_failed(tmp_path: Path, sockdir: str, fault: str) -> None:
    proc, target = start_sidecar(sockdir, config=FIXTURES / "qwen3_8b.json", page_size=16)
    eng = connector_engine(tmp_path, target, retry_s=30.0)
    try:
        # loaded: 63 tokens come from the sidecar and vLLM computes the last one; failed:
        # vLLM recomputes all 64 (kv_load_failure_policy "recompute") instead of dying, and
        # does not load the chunks again though the sidecar still answers HIT for them
        assert scheduled_tokens_after_a_load(eng, proc, fault=fault) == (1 if fault == "none" else 64)
    finally:
        eng.close()
        proc.kill()
        proc.wait(timeout=30)
