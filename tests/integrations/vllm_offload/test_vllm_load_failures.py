"""A load the sidecar cannot serve, through HiCacheConnector: vLLM's scheduler hears of it
(failed_recving for a request waiting on the load, block ids for a load within the step)
instead of the worker failing vLLM 0.33's assertion. vLLM's own factory makes the connector
from the documented kv-transfer-config, and vLLM's OffloadingConnectorWorker runs the jobs
against a live sidecar."""

from __future__ import annotations

import json
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
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult  # noqa: E402
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

from hicache.integrations.vllm import HiCacheConnector, HiCacheLoadStoreSpec  # noqa: E402


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def connector_engine(tmp: Path, target: str, **kw: Any) -> Engine:
    vc = vllm_config(model_dir(tmp, "qwen3_8b"), target, hicache_connector=True, **kw)
    eng = make_engine(vc, [(attention_spec(vc), layer_names(vc.model_config.get_num_layers(vc.parallel_config)))])
    fill(eng, seed=1)
    return start_connector(eng)


def step(eng: Engine, loads: dict[int, TransferJob]) -> tuple[Any, set[int], dict[int, int]]:
    """One step of vLLM's model runner around the connector: bind the metadata, start the
    loads, wait for them, then read the transfer results, the load errors and the worker
    metadata, as vLLM's KVConnectorModelRunnerMixin does."""
    conn = eng.kv_connector
    conn.bind_connector_metadata(OffloadingConnectorMetadata(load_jobs=loads, store_jobs={}))
    conn.start_load_kv(None)
    eng.worker.wait(set(loads))
    results = conn.get_transfer_results(set())
    invalid = conn.get_block_ids_with_load_errors()
    meta = conn.build_connector_worker_meta()
    conn.clear_connector_metadata()
    return results, invalid, dict(meta.completed_jobs) if meta is not None else {}


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
        results, invalid, done = step(eng, {2: TransferJob("req-ok", src, gpu([7, 8]))})
        assert (results.finished_recving, results.failed_recving, invalid, done) == ({"req-ok"}, set(), set(), {2: 1})
        assert all(torch.equal(a, b) for a, b in zip(want, blocks_of(eng, [7, 8]), strict=True))
        proc.kill()
        proc.wait(timeout=30)
        # a request waiting on its load: failed (and finished, so vLLM stops waiting on it)
        results, invalid, done = step(eng, {3: TransferJob("req-a", src, gpu([4, 5]))})
        assert (results.finished_recving, results.failed_recving, invalid) == ({"req-a"}, {"req-a"}, set())
        assert done == {3: 1}  # vLLM's scheduler completes the job (and releases the load's pins)
        # a load its request runs within this step: its blocks, in this step only
        results, invalid, done = step(eng, {4: TransferJob("req-b", src, gpu([9, 10]), sync=True)})
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
        results, invalid, _ = step(eng, {2: TransferJob("req-c", src, gpu([11, 12]), sync=True)})
        assert invalid == {12} and results.failed_recving == set()
        assert torch.equal(blocks_of(eng, [11])[0], blocks_of(eng, [3])[0])
    finally:
        manager.shutdown()
        eng.close()
        proc.terminate()
        proc.wait(timeout=60)


def test_a_spec_other_than_hicaches_is_refused_naming_the_key(tmp_path: Path) -> None:
    vc = vllm_config(model_dir(tmp_path, "qwen3_8b"), "unix:///nowhere.sock", hicache_connector=True)
    vc.kv_transfer_config.kv_connector_extra_config["spec_name"] = "CPUOffloadingSpec"
    eng = make_engine(vc, [(attention_spec(vc), layer_names(2))])
    with pytest.raises(ValueError, match="spec_name='CPUOffloadingSpec'.*HiCacheConnector runs hicache's own"):
        start_connector(eng)
