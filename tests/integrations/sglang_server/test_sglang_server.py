"""SGLang's real server (launch_server on CPU) with hicache's sidecar as its L3: greedy outputs
are the engine alone's, a prefix flushed from SGLang's device and host tiers comes back as
storage hits, and a second engine process is served the first one's pages."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from integrations.vllm_server.tiny_models import llama
from integrations.vllm_server.vllm_server_env import Sidecar, prompt
from sglang_server_env import (
    PAGE,
    SglangServer,
    cached,
    engine_alone,
    hicache_args,
    require_sglang_server,
    start_sglang_server,
)

require_sglang_server()


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[Path, str, Sidecar]]:
    folder = Path(tempfile.mkdtemp(prefix="hcsg"))  # short: the sidecar's socket path
    model = llama(folder / "model")
    sidecar = Sidecar(str(folder), model, PAGE)
    sidecar.start()
    yield folder, model, sidecar
    sidecar.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def alone(request: pytest.FixtureRequest) -> SglangServer:
    return engine_alone(request.config)  # one per pytest run, shared with the other modules


@pytest.fixture(scope="module")
def with_hicache(world: tuple[Path, str, Sidecar]) -> Iterator[SglangServer]:
    folder, model, sidecar = world
    server = start_sglang_server(model, folder / "hicache.log", extra=hicache_args(sidecar.target))
    yield server
    server.stop()


def test_greedy_outputs_match_the_engine_alone(alone: SglangServer, with_hicache: SglangServer) -> None:
    for seed in range(3):
        ids = prompt(seed, 100)
        assert with_hicache.complete(ids) == alone.complete(ids), with_hicache.tail()


def test_a_flushed_prefix_is_served_from_hicache(
    alone: SglangServer, with_hicache: SglangServer, world: tuple[Path, str, Sidecar]
) -> None:
    ids = prompt(100, 160)
    first = with_hicache.generate(ids)
    world[2].wait_stored()
    with_hicache.flush()  # SGLang's device and host tiers forget it; the sidecar keeps it
    again = with_hicache.generate(ids)
    assert again["output_ids"] == first["output_ids"] == alone.complete(ids)
    assert cached(again)["storage"] >= 144, (again["meta_info"], with_hicache.tail())  # 9 of 10 pages


def test_a_second_engine_process_is_served(
    alone: SglangServer, with_hicache: SglangServer, world: tuple[Path, str, Sidecar]
) -> None:
    folder, model, sidecar = world
    ids = prompt(200, 160)
    with_hicache.complete(ids)
    sidecar.wait_stored()
    second = start_sglang_server(model, folder / "second.log", extra=hicache_args(sidecar.target))
    try:
        answer = second.generate(ids)
        assert answer["output_ids"] == alone.complete(ids)
        assert cached(answer)["storage"] >= 144, (answer["meta_info"], second.tail())
    finally:
        second.stop()
