"""SGLang's real server (launch_server on CPU) over one hicache sidecar with a file tier: 8
concurrent requests sharing prefixes give the engine alone's outputs, and after a sidecar
restart the file tier serves what it held, as SGLang's storage hits."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
    folder = Path(tempfile.mkdtemp(prefix="hcss"))  # short: the sidecar's socket path
    side = Sidecar(str(folder), llama(folder / "model"), PAGE)  # the file tier in <folder>/tier
    side.start()
    yield side
    side.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def server(sidecar: Sidecar) -> Iterator[SglangServer]:
    # SGLang skips a request's storage prefetch while the prefetches in flight hold half its
    # host pool (cache_controller.prefetch_rate_limited): with the default 2x host pool (512
    # tokens) two of the 8 concurrent requests fill that, and whether one of them asks for the
    # prefix hicache holds was luck. 16x (4096 tokens) leaves room for all 8.
    engine = start_sglang_server(
        sidecar.model, Path(sidecar.sockdir) / "server.log", extra=hicache_args(sidecar.target), host_ratio=16.0
    )
    yield engine
    engine.stop()


def test_eight_concurrent_requests_sharing_prefixes_give_the_engine_alones_outputs(
    server: SglangServer, sidecar: Sidecar, reference: Reference
) -> None:
    """Two system prompts of 4 pages, 4 questions each: 8 requests at once (together far
    more than SGLang's 256-token device pool, so most wait). One system prompt is in the
    sidecar only (served, then flushed from SGLang's device and host tiers); the other is new."""
    systems = [prompt(110, 4 * PAGE), prompt(111, 4 * PAGE)]
    before = used_pages(sidecar)
    server.complete(systems[0] + prompt(112, PAGE))
    wait_held(sidecar, before, 5)
    server.flush()
    asks = [system + prompt(120 + i, 40 + 8 * i) for i, system in enumerate(systems * 4)]
    want = [reference(ids) for ids in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(server.generate, asks))
    assert [a["output_ids"] for a in answers] == want
    from_storage = [cached(a)["storage"] for a in answers]
    assert max(from_storage) >= 4 * PAGE, ([a["meta_info"] for a in answers], server.tail())


def test_after_a_sidecar_restart_its_file_tier_serves_the_prefix(
    server: SglangServer, sidecar: Sidecar, reference: Reference
) -> None:
    q = prompt(130, 160)
    before = used_pages(sidecar)
    assert server.complete(q) == reference(q)  # stored: host memory, then the file tier
    wait_held(sidecar, before, 9)
    sidecar.wait_stored()
    sidecar.stop()
    sidecar.start()  # a new process: its host memory is empty, the file tier is kept
    assert used_pages(sidecar) == 0
    settle(server, sidecar, seed=140)  # the adapter registered its pool again
    server.flush()  # only the file tier has q now
    answer = server.generate(q)
    assert answer["output_ids"] == reference(q)
    assert cached(answer)["storage"] >= 9 * PAGE, (answer["meta_info"], server.tail())
