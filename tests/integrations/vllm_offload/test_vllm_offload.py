"""hicache as vLLM 0.33's offloading backend, against vLLM's real classes: its spec factory,
build_offloading_config, KV-cache views of real KVCacheSpecs, the OffloadingConnectorWorker
that builds CanonicalKVCaches, and a live hicache-server on a Unix socket. The scheduler and
the worker are driven through the calls vLLM's OffloadingConnector makes; a whole vLLM
engine cannot run on this CPU-only machine."""

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
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_env import (  # noqa: E402
    FIXTURES,
    Engine,
    attention_spec,
    fill,
    make_engine,
    model_dir,
    sidecar_dir,
    start_worker,
    vllm_config,
)

from hicache.api import Tier  # noqa: E402
from hicache.client import HiCacheRpcError  # noqa: E402
from hicache.geometry import model_geometries  # noqa: E402
from hicache.integrations.vllm import HiCacheOffloadingSpec  # noqa: E402
from hicache.integrations.vllm.keys import chunk_page_keys  # noqa: E402

CTX = ReqContext(req_id="req-1")


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


@pytest.fixture
def sidecar(sockdir: str) -> Iterator[str]:
    proc, target = start_sidecar(sockdir, config=FIXTURES / "qwen3_8b.json", page_size=16)
    yield target
    proc.terminate()
    proc.wait(timeout=60)


def layer_names(n: int, ids: Any = None) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in (ids if ids is not None else range(n))]


def qwen_engine(tmp: Path, target: str, **kw: Any) -> Engine:
    vc = vllm_config(model_dir(tmp, "qwen3_8b"), target, **{k: v for k, v in kw.items() if k != "layout"})
    layers = layer_names(vc.model_config.get_num_layers(vc.parallel_config))
    eng = make_engine(vc, [(attention_spec(vc), layers)], num_blocks=16, layout=kw.get("layout", "LBNHC"))
    fill(eng, seed=vc.parallel_config.rank + 1)
    return start_worker(eng)


def chunk_keys(n: int, group: int = 0, seed: int = 0) -> list[bytes]:
    return [make_offload_key(bytes([seed, i]) * 16, group) for i in range(n)]


def blocks_of(eng: Engine, blocks: list[int]) -> list[torch.Tensor]:
    return [eng.block(name, b) for name in eng.kv_caches for b in blocks]


def resolve(manager: Any, keys: list[bytes]) -> list[Any]:
    """What vLLM's scheduler sees: lookups, the end of the step, and lookups again once the
    manager has no pending work."""
    with manager.lock:
        first = [manager.lookup(k, CTX) for k in keys]
        manager.on_schedule_end(None)
    deadline = time.monotonic() + 30
    while manager.has_pending_work() and time.monotonic() < deadline:
        time.sleep(0.005)
    with manager.lock:
        return first + [manager.lookup(k, CTX) for k in keys]


def store(eng: Engine, manager: Any, keys: list[bytes], blocks: list[int], job: int, group: int = 0) -> Any:
    with manager.lock:
        out = manager.prepare_store(keys, CTX)
    sizes = [0] * len(eng.offloading_config.groups)
    sizes[group] = len(blocks)
    eng.worker.submit_store(
        job, GPULoadStoreSpec(blocks, group_sizes=sizes, block_indices=[0] * len(sizes)), out.store_spec
    )
    eng.worker.wait({job})
    (result,) = eng.worker.get_finished()
    with manager.lock:
        manager.complete_store(out.keys_to_store, CTX)
    return result


def load(
    eng: Engine, manager: Any, keys: list[bytes], blocks: list[int], job: int, first: int = 0, group: int = 0
) -> Any:
    with manager.lock:
        src = manager.prepare_load(keys, CTX)
    sizes, starts = [0] * len(eng.offloading_config.groups), [0] * len(eng.offloading_config.groups)
    sizes[group], starts[group] = len(blocks), first
    eng.worker.submit_load(job, src, GPULoadStoreSpec(blocks, group_sizes=sizes, block_indices=starts))
    eng.worker.wait({job})
    (result,) = eng.worker.get_finished()
    with manager.lock:
        manager.complete_load(keys, CTX)
    return result


def test_vllms_factory_loads_the_spec_from_the_documented_kv_transfer_config() -> None:
    cli = json.loads(
        '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
        '{"spec_name":"HiCacheOffloadingSpec","spec_module_path":"hicache.integrations.vllm",'
        '"target":"unix:///run/hicache/hicache.sock"}}'
    )
    assert OffloadingSpecFactory.get_spec_cls(cli["kv_connector_extra_config"]) is HiCacheOffloadingSpec


def test_store_then_load_is_bit_exact_through_vllms_own_views(tmp_path: Path, sidecar: str) -> None:
    eng = qwen_engine(tmp_path, sidecar)
    manager = eng.spec.get_manager()
    try:
        keys = chunk_keys(3)
        assert resolve(manager, keys) == [LookupResult.RETRY] * 3 + [LookupResult.MISS] * 3
        want = blocks_of(eng, [1, 2, 3])
        result = store(eng, manager, keys, [1, 2, 3], job=1)
        assert result.success and result.transfer_size == 3 * eng.worker.links[0].geometry.page_bytes
        assert resolve(manager, keys)[3:] == [LookupResult.HIT] * 3
        eng.raw.zero_()
        assert load(eng, manager, keys, [7, 9, 11], job=2).success
        got = blocks_of(eng, [7, 9, 11])
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert not any(blocks_of(eng, [1, 2, 3])[0].any() for _ in [0])  # only the load's blocks were written
    finally:
        manager.shutdown()
        eng.close()


def test_lookup_answers_follow_the_page_across_host_and_storage(tmp_path: Path, sidecar: str) -> None:
    eng = qwen_engine(tmp_path, sidecar)
    manager = eng.spec.get_manager()
    client, link = eng.worker.client, eng.worker.links[0]
    try:
        keys = chunk_keys(2, seed=5)
        store(eng, manager, keys, [4, 5], job=1)
        want = blocks_of(eng, [4, 5])
        pages = [p for k in keys for p in chunk_page_keys(k, 1)]
        deadline = time.monotonic() + 30
        while client.stats(link.pool_id)[0].storage_write_queue and time.monotonic() < deadline:
            time.sleep(0.01)
        client.evict(pages, pool=link.pool_id)  # host -> gone; the file tier still has them
        assert client.lookup(pages, pool=link.pool_id).tiers == (Tier.STORAGE, Tier.STORAGE)
        with manager.lock:
            manager.reset_cache()
        # one resolution: the lookup thread prefetches the pages and waits for them, then pins
        assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
        assert client.lookup(pages, pool=link.pool_id).tiers == (Tier.HOST, Tier.HOST)
        eng.raw.zero_()
        assert load(eng, manager, keys, [0, 1], job=2).success
        assert all(torch.equal(a, b) for a, b in zip(want, blocks_of(eng, [0, 1]), strict=True))
        assert resolve(manager, chunk_keys(1, seed=9))[1:] == [LookupResult.MISS]
    finally:
        manager.shutdown()
        eng.close()


def test_chunks_of_two_blocks_load_from_mid_chunk(tmp_path: Path, sidecar: str) -> None:
    eng = qwen_engine(tmp_path, sidecar, blocks_per_chunk=2)
    assert eng.offloading_config.cache.blocks_per_chunk == 2
    manager = eng.spec.get_manager()
    try:
        keys = chunk_keys(2, seed=3)  # 2 chunks = 4 blocks
        store(eng, manager, keys, [2, 3, 4, 5], job=1)
        want = blocks_of(eng, [3, 4, 5])
        eng.raw.zero_()
        # vLLM's GPU spec for logical blocks 1..3 of the request: the first chunk starts mid-chunk
        assert load(eng, manager, keys, [10, 11, 12], job=2, first=1).success
        assert all(torch.equal(a, b) for a, b in zip(want, blocks_of(eng, [10, 11, 12]), strict=True))
    finally:
        manager.shutdown()
        eng.close()


def test_block_outermost_layout_packs_every_layer_into_one_region(tmp_path: Path, sidecar: str) -> None:
    eng = qwen_engine(tmp_path, sidecar, layout="BLNHC")
    manager = eng.spec.get_manager()
    try:
        link = eng.worker.links[0]
        _, offset, layer_stride, block_stride = link.memory.layout.split(":")
        assert int(layer_stride) == link.geometry.page_bytes_for(1)
        assert int(block_stride) == link.geometry.page_bytes
        keys = chunk_keys(2, seed=7)
        store(eng, manager, keys, [6, 8], job=1)
        want = blocks_of(eng, [6, 8])
        eng.raw.zero_()
        assert load(eng, manager, keys, [1, 2], job=2).success
        assert all(torch.equal(a, b) for a, b in zip(want, blocks_of(eng, [1, 2]), strict=True))
    finally:
        manager.shutdown()
        eng.close()


def mimo_groups(vc: Any) -> list[tuple[Any, list[str]]]:
    """MiMo-V2-Flash's two KV-cache groups (K 192 / V 128): full layers, and sliding-window
    layers with their own head count, as hicache's model config reader splits them."""
    cfg = json.loads((FIXTURES / "mimo_v2_flash.json").read_text())
    groups = model_geometries(cfg, tp_size=1, page_size=16, dtype="bfloat16")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    out = []
    for name, cls in (("full", FullAttentionSpec), ("swa", SlidingWindowSpec)):
        g = groups[name]
        extra = {"sliding_window": int(cfg["sliding_window"])} if name == "swa" else {}
        spec = cls(block_size=16, num_kv_heads=g.head_num, head_size=g.head_dim, head_size_v=g.v_head_dim,
                   dtype=torch.bfloat16, **extra)  # fmt: skip
        out.append((spec, layer_names(0, g.layer_ids)))
    return out


@pytest.fixture
def mimo_sidecar(sockdir: str) -> Iterator[str]:
    proc, target = start_sidecar(sockdir, config=FIXTURES / "mimo_v2_flash.json", page_size=16)
    yield target
    proc.terminate()
    proc.wait(timeout=60)


def test_two_groups_with_k_and_v_of_different_dims(tmp_path: Path, mimo_sidecar: str) -> None:
    vc = vllm_config(model_dir(tmp_path, "mimo_v2_flash"), mimo_sidecar)
    eng = make_engine(vc, mimo_groups(vc), num_blocks=4)
    fill(eng, seed=11)
    start_worker(eng)
    manager = eng.spec.get_manager()
    try:
        full, swa = eng.worker.links
        assert (full.name, swa.name) == ("full", "swa")
        assert (full.geometry.head_dim, full.geometry.v_head_dim) == (192, 128)
        assert full.geometry.page_bytes_for(1) == mimo_groups(vc)[0][0].page_size_bytes  # vLLM's own count
        keys_full, keys_swa = chunk_keys(2, group=0, seed=1), chunk_keys(2, group=1, seed=1)
        store(eng, manager, keys_full, [0, 1], job=1, group=0)
        store(eng, manager, keys_swa, [2, 3], job=2, group=1)
        want = blocks_of(eng, [0, 1, 2, 3])
        assert resolve(manager, keys_full + keys_swa)[4:] == [LookupResult.HIT] * 4
        eng.raw.zero_()
        assert load(eng, manager, keys_full, [0, 1], job=3, group=0).success
        assert load(eng, manager, keys_swa, [2, 3], job=4, group=1).success
        got = blocks_of(eng, [0, 1, 2, 3])
        full_layers = set(mimo_groups(vc)[0][1])
        for (name, block), a, b in zip([(n, b) for n in eng.kv_caches for b in range(4)], want, got, strict=True):
            mine = (name in full_layers) == (block < 2)  # each group loaded only its own blocks
            assert torch.equal(a, b) if mine else not b.any()
    finally:
        manager.shutdown()
        eng.close()


def test_a_sidecar_for_another_tp_size_stops_vllms_start_up(tmp_path: Path, sidecar: str) -> None:
    with pytest.raises(HiCacheRpcError, match=r"head_num \(engine 4, sidecar 8\)"):
        qwen_engine(tmp_path, sidecar, rank=0, tp=2)


def test_tp_ranks_keep_their_own_pages_and_a_chunk_hits_only_when_every_rank_has_it(
    tmp_path: Path, sockdir: str
) -> None:
    proc, target = start_sidecar(sockdir, "--tp-size", "2", config=FIXTURES / "qwen3_8b.json", page_size=16)
    ranks = [qwen_engine(tmp_path, target, rank=r, tp=2) for r in (0, 1)]
    manager = ranks[0].spec.get_manager()  # the scheduler's, on rank 0's spec
    try:
        keys = chunk_keys(2, seed=2)
        want = [blocks_of(e, [3, 4]) for e in ranks]
        assert not torch.equal(want[0][0], want[1][0])
        store(ranks[0], manager, keys, [3, 4], job=1)
        assert resolve(manager, keys)[2:] == [LookupResult.MISS] * 2  # rank 1 has not stored
        store(ranks[1], manager, keys, [3, 4], job=1)
        assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
        for e in ranks:
            e.raw.zero_()
        for job, e in enumerate(ranks, start=2):
            assert load(e, manager, keys, [8, 9], job=job).success
        for e, w in zip(ranks, want, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(w, blocks_of(e, [8, 9]), strict=True))
    finally:
        manager.shutdown()
        for e in ranks:
            e.close()
        proc.terminate()
        proc.wait(timeout=60)
