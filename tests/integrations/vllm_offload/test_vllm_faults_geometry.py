"""The vLLM adapter when things go wrong (a sidecar that is down or restarts, memory the
sidecar cannot map, a model config that does not describe vLLM's cache, bad options), and
the KVGeometry it builds from vLLM's own KVCacheSpec classes."""

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
from test_vllm_offload import CTX, blocks_of, chunk_keys, layer_names, load, qwen_engine, resolve, store  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm_env import FIXTURES, attention_spec, fill, make_engine, model_dir, sidecar_dir, start_worker, vllm_config  # noqa: E402

from hicache.client.health import check_health  # noqa: E402
from hicache.geometry import model_geometries  # noqa: E402
from hicache.integrations.vllm.geometry import geometry_from_hf, geometry_from_spec  # noqa: E402


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def qwen_sidecar(sockdir: str) -> tuple[Any, str]:
    return start_sidecar(sockdir, config=FIXTURES / "qwen3_8b.json", page_size=16)


def test_a_sidecar_that_dies_gives_misses_and_refused_stores_never_an_exception(tmp_path: Path, sockdir: str) -> None:
    proc, target = qwen_sidecar(sockdir)
    # 30 s: the first registration loads torch in the sidecar; a dead sidecar fails at once anyway
    eng = qwen_engine(tmp_path, target, timeout_s=30.0, retry_s=30.0)
    manager = eng.spec.get_manager()
    try:
        keys = chunk_keys(2)
        store(eng, manager, keys, [1, 2], job=1)
        assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
        proc.kill()
        proc.wait(timeout=30)
        with manager.lock:
            manager.reset_cache()
        assert resolve(manager, keys) == [LookupResult.RETRY] * 2 + [LookupResult.MISS] * 2
        with manager.lock:  # within retry_s: answered at once, no call made
            assert manager.lookup(chunk_keys(1, seed=4)[0], CTX) is LookupResult.MISS
            assert manager.prepare_store(chunk_keys(1, seed=4), CTX) is None
            spec = manager.prepare_load(keys, CTX)  # a pin that fails is logged, not raised
            manager.complete_load(keys, CTX)
        # the worker: a store that the sidecar cannot take still completes (it is a later
        # miss); a load that cannot be served is a failed job, as vLLM's interface has it
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        eng.worker.submit_store(2, GPULoadStoreSpec([3, 6], group_sizes=[2], block_indices=[0]), spec)
        eng.worker.submit_load(3, spec, GPULoadStoreSpec([4, 5], group_sizes=[2], block_indices=[0]))
        eng.worker.wait({2, 3})
        results = {r.job_id: r.success for r in eng.worker.get_finished()}
        assert results == {2: True, 3: False}
    finally:
        manager.shutdown()
        eng.close()


def test_after_a_sidecar_restart_the_worker_registers_again_and_the_scheduler_follows(
    tmp_path: Path, sockdir: str
) -> None:
    proc, target = qwen_sidecar(sockdir)
    eng = qwen_engine(tmp_path, target, retry_s=0.2)
    manager = eng.spec.get_manager()
    try:
        old = eng.worker.links[0].pool_id
        before = chunk_keys(1, seed=9)  # a load in flight across the restart: pins on the old pool
        assert store(eng, manager, before, [2], job=9).success
        assert resolve(manager, before)[1:] == [LookupResult.HIT]
        with manager.lock:
            manager.prepare_load(before, CTX)
        proc.terminate()
        proc.wait(timeout=60)
        proc, _ = qwen_sidecar(sockdir)
        deadline = time.monotonic() + 60
        while check_health(target) != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
        # the worker's watchdog (every retry_s) registers again once the sidecar answers; a
        # store made first may find the client's channel still backing off (UNAVAILABLE: not kept)
        while eng.worker.links[0].pool_id in ("", old) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.worker.links[0].pool_id not in ("", old)  # registered again, and published
        keys = chunk_keys(2, seed=8)
        want = blocks_of(eng, [5, 6])
        assert store(eng, manager, keys, [5, 6], job=1).success
        deadline = time.monotonic() + 30
        answers = resolve(manager, keys)
        while answers[2:] != [LookupResult.HIT] * 2 and time.monotonic() < deadline:
            time.sleep(0.25)  # the first lookups may meet the old pool id: misses for retry_s
            with manager.lock:
                manager.reset_cache()
            answers = resolve(manager, keys)
        assert answers[2:] == [LookupResult.HIT] * 2
        eng.raw.zero_()
        assert load(eng, manager, keys, [0, 1], job=2).success
        assert all(torch.equal(a, b) for a, b in zip(want, blocks_of(eng, [0, 1]), strict=True))
        with manager.lock:
            manager.complete_load(before, CTX)  # its pins name the old pool: dropped, not kept
            manager.reset_cache()
        assert manager.pinned_pages() == 0
        client, pool, deadline = eng.worker.client, eng.worker.links[0].pool_id, time.monotonic() + 30
        while client.stats(pool)[0].pinned_pages and time.monotonic() < deadline:
            time.sleep(0.01)  # the unpins run on the manager's lookup thread
        assert client.stats(pool)[0].pinned_pages == 0
    finally:
        manager.shutdown()
        eng.close()
        proc.terminate()
        proc.wait(timeout=60)


def test_private_memory_is_copied_by_the_worker_bit_exact(tmp_path: Path, sockdir: str) -> None:
    """vLLM's CPU worker allocates its KV cache with torch.zeros, which the sidecar cannot
    map: the worker maps the sidecar's host pool and copies itself (copy path "engine")."""
    proc, target = qwen_sidecar(sockdir)
    try:
        vc = vllm_config(model_dir(tmp_path, "qwen3_8b"), target)
        eng = make_engine(vc, [(attention_spec(vc), layer_names(36))], num_blocks=8, memfd=False)
        fill(eng, seed=3)
        start_worker(eng)
        manager = eng.spec.get_manager()
        try:
            link = eng.worker.links[0]
            assert link.memory.private is not None and link.memory.fd == -1
            (stats,) = eng.worker.client.stats(link.pool_id)
            assert stats.copy_path == "engine"
            keys = chunk_keys(2, seed=7)
            want = blocks_of(eng, [1, 2])
            before = eng.raw.clone()
            assert store(eng, manager, keys, [1, 2], job=1).success
            assert torch.equal(eng.raw, before)  # the store read vLLM's blocks, wrote nothing there
            assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
            eng.raw.zero_()
            assert load(eng, manager, keys, [5, 6], job=2).success
            assert all(torch.equal(a, b) for a, b in zip(want, blocks_of(eng, [5, 6]), strict=True))
            assert not blocks_of(eng, [1])[0].any()  # only the load's blocks were written
        finally:
            manager.shutdown()
            eng.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_model_config_that_does_not_describe_vllms_cache_is_refused(tmp_path: Path, sockdir: str) -> None:
    proc, target = start_sidecar(sockdir, config=FIXTURES / "qwen3_8b.json", page_size=16)
    try:
        other = str(FIXTURES / "mimo_v2_flash.json")  # 4 KV heads of K 192 / V 128, not 8 of 128
        with pytest.raises(ValueError, match=r"vLLM group 0: blocks of \[65536\] bytes per layer.* gives 40960"):
            qwen_engine(tmp_path, target, model_config=other)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("timeout_s", 0, "'timeout_s' must be a number > 0"),
        ("target", "", "'target' must be a non-empty string"),
        ("model_config", 3, "'model_config' must be a string"),
    ],
)
def test_bad_options_fail_the_spec_naming_the_key(tmp_path: Path, key: str, value: Any, message: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    extra = {key: value}
    vc = vllm_config(model_dir(tmp_path, "qwen3_8b"), extra.pop("target", "unix:///nowhere.sock"), **extra)
    eng = make_engine(vc, [(attention_spec(vc), layer_names(36))], num_blocks=2)
    with pytest.raises(ValueError, match=message):
        OffloadingSpecFactory.create_spec(build_offloading_config(vc, eng.kv_cache_config))
    eng.close()


def test_mla_latents_round_trip(tmp_path: Path, sockdir: str) -> None:
    proc, target = start_sidecar(sockdir, config=FIXTURES / "deepseek_v3.json", page_size=16)
    try:
        vc = vllm_config(model_dir(tmp_path, "deepseek_v3"), target)
        spec = attention_spec(vc)
        assert isinstance(spec, MLAAttentionSpec) and spec.head_size == 576
        eng = make_engine(vc, [(spec, layer_names(vc.model_config.get_num_layers(vc.parallel_config)))], num_blocks=4)
        fill(eng, seed=3)
        start_worker(eng)
        manager = eng.spec.get_manager()
        geometry = eng.worker.links[0].geometry
        assert (geometry.attention, geometry.kv_lora_rank, geometry.qk_rope_head_dim) == ("mla", 512, 64)
        keys = chunk_keys(2, seed=6)
        store(eng, manager, keys, [0, 3], job=1)
        want = blocks_of(eng, [0, 3])
        eng.raw.zero_()
        assert load(eng, manager, keys, [1, 2], job=2).success
        assert all(torch.equal(a, b) for a, b in zip(want, blocks_of(eng, [1, 2]), strict=True))
        manager.shutdown()
        eng.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("model", ["mimo_v2_flash", "qwen3_8b", "llama_3_1_8b", "deepseek_v3"])
def test_geometry_from_vllms_specs_matches_the_model_config_byte_for_byte(model: str) -> None:
    """vLLM's own KVCacheSpec classes and hicache's HF config reader describe the same page:
    the same fields and exactly vLLM's bytes per block."""
    cfg = json.loads((FIXTURES / f"{model}.json").read_text())
    for name, g in model_geometries(cfg, tp_size=1, page_size=16, dtype="bfloat16").items():
        if g.attention == "mla":
            spec: Any = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=g.head_dim, dtype=torch.bfloat16)
        else:
            cls: Any = SlidingWindowSpec if name == "swa" else FullAttentionSpec
            extra = {"sliding_window": 128} if name == "swa" else {}
            spec = cls(block_size=16, num_kv_heads=g.head_num, head_size=g.head_dim, head_size_v=g.v_head_dim,
                       dtype=torch.bfloat16, **extra)  # fmt: skip
        mine = geometry_from_spec(spec, g.layer_num, g.layer_ids, cfg)  # cfg: an MLA latent's split
        assert mine.page_bytes_for(1) == spec.page_size_bytes == g.page_bytes_for(1)
        names = layer_names(0, g.layer_ids)
        from_hf = geometry_from_hf(
            cfg, sliding=name == "swa", layer_names=names, tp_size=1, page_size=16, dtype="bfloat16"
        )
        assert mine.diff(from_hf) == []


def test_an_mla_latent_the_model_config_does_not_split_into_is_refused_naming_both() -> None:
    cfg = json.loads((FIXTURES / "deepseek_v3.json").read_text())
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=640, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"kv_lora_rank 512 \+ qk_rope_head_dim 64 = 576.*head_size\) is 640"):
        geometry_from_spec(spec, 2, None, cfg)
    with pytest.raises(ValueError, match="needs the model config"):
        geometry_from_spec(spec, 2)


def test_mla_inside_a_vllm_worker_registers_the_model_configs_split(tmp_path: Path, sockdir: str) -> None:
    """In a vLLM worker (set_current_vllm_config, attention layers built) the geometry comes
    from vLLM's MLA spec, whose latent width the HF config splits into 512 + 64."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    proc, target = start_sidecar(sockdir, config=FIXTURES / "deepseek_v3.json", page_size=16)
    try:
        vc = vllm_config(model_dir(tmp_path, "deepseek_v3"), target, timeout_s=30.0)
        spec = attention_spec(vc)
        names = layer_names(vc.model_config.get_num_layers(vc.parallel_config))

        class Layer(AttentionLayerBase):  # what vLLM's MLA attention layers answer
            def get_attn_backend(self) -> Any:
                raise NotImplementedError

            def get_kv_cache_spec(self, vllm_config: Any) -> Any:
                return spec

        vc.compilation_config.static_forward_context.update({n: Layer() for n in names})
        eng = make_engine(vc, [(spec, names)], num_blocks=4)
        with set_current_vllm_config(vc):
            start_worker(eng)
        geometry = eng.worker.links[0].geometry
        assert (geometry.attention, geometry.kv_lora_rank, geometry.qk_rope_head_dim) == ("mla", 512, 64)
        eng.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_specs_with_packed_or_quantized_cells_are_refused() -> None:
    from vllm.v1.kv_cache_interface import KVQuantMode

    modes = [m for m in KVQuantMode if m != KVQuantMode.NONE]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, kv_quant_mode=modes[0])
    with pytest.raises(ValueError, match="packed or quantized cells"):
        geometry_from_spec(spec, 2)


def test_plan_moves_pairs_blocks_with_chunk_pages_and_refuses_specs_that_do_not_cover() -> None:
    from hicache.integrations.vllm.keys import page_key, plan_moves

    full, swa = chunk_keys(2, group=0), chunk_keys(1, group=1)
    # group 0: logical blocks 3..5 with 2 blocks per chunk = the second half of chunk 0, chunk 1
    moves = plan_moves(full + swa, [10, 11, 12, 20], [3, 1], [3, 0], blocks_per_chunk=2)
    assert [(m.group, m.blocks) for m in moves] == [(0, [10, 11, 12]), (1, [20])]
    assert moves[0].keys == [page_key(full[0], 1), page_key(full[1], 0), page_key(full[1], 1)]
    assert moves[1].keys == [page_key(swa[0], 0)]
    with pytest.raises(ValueError, match="span 2 chunks, got 1 keys"):
        plan_moves(full[:1], [10, 11, 12], [3], [0], blocks_per_chunk=2)
    with pytest.raises(ValueError, match=r"keys of groups \[1\] have no blocks"):
        plan_moves(full + swa, [10, 11, 12, 13], [4, 0], [0, 0], blocks_per_chunk=2)
    with pytest.raises(ValueError, match="do not describe 2 blocks"):
        plan_moves(full, [10, 11], [3], [0], blocks_per_chunk=2)
