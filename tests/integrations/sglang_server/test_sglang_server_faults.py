"""SGLang's real server (launch_server on CPU) when its hicache sidecar is not there: down when
the engine starts (it starts and serves, saying so in one line), killed mid-run (it keeps
serving the same outputs) and back (hits return). One engine, in file order: it starts with
the sidecar down. The sidecar has no storage tier, so a restart loses every page."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from integrations.server_process import Reference
from integrations.vllm_server.tiny_models import llama
from integrations.vllm_server.vllm_server_env import Sidecar, prompt
from sglang_server_env import (
    PAGE,
    SglangServer,
    cached,
    engine_alone,
    hicache_args,
    hicache_warnings,
    require_sglang_server,
    settle,
    start_sglang_server,
    used_pages,
    wait_held,
)

require_sglang_server()


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest) -> Reference:
    return Reference(engine_alone(request.config))


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    """Not started: the tests start, kill and restart it."""
    folder = Path(tempfile.mkdtemp(prefix="hcsf"))  # short: the sidecar's socket path
    side = Sidecar(str(folder), llama(folder / "model"), PAGE, ("--hicache-storage-backend", "none"))
    yield side
    side.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def server(sidecar: Sidecar) -> Iterator[SglangServer]:
    """Started while its sidecar is down; its log lines carry their level."""
    assert not sidecar.up
    log = Path(sidecar.sockdir) / "server.log"
    engine = start_sglang_server(sidecar.model, log, extra=hicache_args(sidecar.target), levelled=True)
    yield engine
    engine.stop()


def test_an_engine_started_without_its_sidecar_serves_the_engine_alones_outputs(
    server: SglangServer, reference: Reference
) -> None:
    a = prompt(201, 160)
    answers = [server.generate(a)]
    server.flush()  # SGLang's device and host tiers forget it: recomputed
    answers.append(server.generate(a))
    assert [x["output_ids"] for x in answers] == [reference(a)] * 2
    for seed in (205, 206):
        ids = prompt(seed, 150)
        answers.append(server.generate(ids))
        assert answers[-1]["output_ids"] == reference(ids)
    assert all(cached(x)["storage"] == 0 for x in answers), [x["meta_info"] for x in answers]


def test_an_engine_started_without_its_sidecar_says_so_in_one_line(server: SglangServer, sidecar: Sidecar) -> None:
    """After the requests above (each asked SGLang's L3): the adapter's one line, nothing more."""
    assert not sidecar.up
    lines = hicache_warnings(server.log.read_text(errors="replace"))
    assert len(lines) == 1, "\n".join(lines)
    assert "does not answer" in lines[0] and sidecar.target in lines[0], lines[0]


def test_a_sidecar_killed_mid_run_costs_only_recomputation_and_hits_return_when_it_is_back(
    server: SglangServer, sidecar: Sidecar, reference: Reference
) -> None:
    if not sidecar.up:
        sidecar.start()
    settle(server, sidecar, seed=210)  # the adapter registers once the sidecar answers
    b = prompt(230, 160)
    before = used_pages(sidecar)
    assert server.complete(b) == reference(b)
    wait_held(sidecar, before, 9)  # b's 9 full pages reach the sidecar (its 10th is partial)
    sidecar.kill()
    server.flush()
    answer = server.generate(b)  # a lookup meets the dead sidecar: computed
    assert answer["output_ids"] == reference(b)
    assert cached(answer)["storage"] == 0, answer["meta_info"]
    for seed in (234, 235):  # their stores fail now
        ids = prompt(seed, 150)
        assert server.complete(ids) == reference(ids)
    sidecar.start()  # empty: no storage tier
    settle(server, sidecar, seed=240)  # the adapter registers again (the sidecar forgot its pool)
    c = prompt(260, 160)
    before = used_pages(sidecar)
    assert server.complete(c) == reference(c)
    wait_held(sidecar, before, 9)
    server.flush()
    again = server.generate(c)
    assert again["output_ids"] == reference(c)
    assert cached(again)["storage"] >= 9 * PAGE, (again["meta_info"], server.tail())
    assert server.proc.poll() is None
