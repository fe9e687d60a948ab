"""deploy/compose.cpu.yml under a real Docker engine, SGLang's profile: SGLang 0.5.23's server on
CPU (with the test support's stand-ins for its CPU gaps) serving the real-server tests' tiny
seeded Llama with hicache as its storage tier (HiCacheSidecarStorage) and Redis behind the
sidecar, all in containers, driven through their published loopback ports. The
`sglang-reference` profile's SGLang without hicache gives the outputs every answer must equal.

In file order, on one running project: the engine starts once the sidecar is healthy; a
prefix flushed from SGLang's device and host tiers comes back from hicache (counted by SGLang
and by the sidecar's /metrics); the sidecar SIGKILLed mid-run and started again costs nothing
but recomputation, and hits return."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from integrations.sglang_server.sglang_server_env import SglangServer, cached, hicache_args
from integrations.vllm_server.vllm_server_env import prompt

from .compose_local import ROOT, read_compose
from .docker_project import Project, engine_stack, scrape, total

COMPOSE = ROOT / "deploy" / "compose.cpu.yml"
PAGE = 32  # the file's --page-size


class Stack:
    """The running project: SGLang with hicache, SGLang alone, and the sidecar's /metrics."""

    def __init__(self, project: Project, up_log: str) -> None:
        self.project, self.up_log, env = project, up_log, project.env
        self.sglang = SglangServer(None, f"http://127.0.0.1:{env['SGLANG_PORT']}", None)  # type: ignore[arg-type]
        self.alone = SglangServer(None, f"http://127.0.0.1:{env['SGLANG_ALONE_PORT']}", None)  # type: ignore[arg-type]
        self.metrics_port = int(env["HICACHE_METRICS_HOST_PORT"])

    def sidecar(self) -> dict[str, float]:
        return scrape("127.0.0.1", self.metrics_port)

    def used_pages(self) -> float:
        return total(self.sidecar(), "hicache_host_pool_pages", state="used")

    def generate(self, ids: list[int]) -> dict[str, int]:
        """SGLang with hicache's answer for `ids`, whose output must equal SGLang alone's; where
        its cached prompt tokens came from (device, host, storage)."""
        answer = self.sglang.generate(ids)
        assert answer["output_ids"] == self.alone.complete(ids), ids[:8]
        return cached(answer)

    def wait_held(self, before: float, pages: int, tries: int = 300) -> None:
        """Until the sidecar holds `pages` more host pages than `before` (SGLang backs pages up
        in the background)."""
        for _ in range(tries):
            if self.used_pages() >= before + pages:
                return
            time.sleep(0.1)
        raise AssertionError(f"the sidecar holds {self.used_pages()} pages, not {before} + {pages}")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with engine_stack(
        "hicache-test-sglang-cpu",
        (COMPOSE,),
        ("sglang", "sglang-reference"),
        ("SGLANG_PORT", "SGLANG_ALONE_PORT"),
        Stack,
        lambda s: (s.sglang.url + "/health_generate", s.alone.url + "/health_generate"),
        {"sglang": 4000, "hicache": 2000},
    ) as stack:
        yield stack


def test_the_compose_file_configures_hicache_as_the_real_server_tests_do() -> None:
    s = read_compose(COMPOSE)["services"]
    assert s["sglang"]["entrypoint"] == s["sglang-alone"]["entrypoint"]  # the same engine, but hicache
    flags = dict(a.removeprefix("--").split("=", 1) for a in s["sglang"]["command"])
    target = "unix://" + s["hicache"]["environment"]["HICACHE_SOCKET"]
    tests = hicache_args(target, prefetch_threshold=PAGE)
    assert flags == {tests[i].removeprefix("--"): tests[i + 1] for i in range(0, len(tests), 2)} | {
        "hicache-storage-backend-extra-config": flags["hicache-storage-backend-extra-config"]
    }
    assert json.loads(flags["hicache-storage-backend-extra-config"]) == json.loads(tests[-1])
    assert f"--page-size={PAGE}" in s["sglang"]["entrypoint"] and f"--page-size={PAGE}" in s["hicache"]["command"]


def test_the_engine_starts_once_the_sidecar_is_healthy(stack: Stack) -> None:
    lines = stack.up_log.splitlines()
    healthy = next(i for i, line in enumerate(lines) if "hicache-1" in line and "Healthy" in line)
    started = next(i for i, line in enumerate(lines) if "sglang-1" in line and "Start" in line)
    assert healthy < started, stack.up_log


def test_a_flushed_prefix_is_served_from_hicache(stack: Stack) -> None:
    for seed in range(3):
        stack.generate(prompt(seed, 100))
    ids = prompt(100, 160)  # 5 pages
    before = stack.used_pages()
    stack.generate(ids)
    stack.wait_held(before, 4)
    stack.sglang.flush()  # SGLang's device and host tiers forget it; the sidecar keeps it
    metrics = stack.sidecar()
    again = stack.generate(ids)
    assert again["storage"] >= 4 * PAGE, again  # 4 of 5 pages
    hits = total(stack.sidecar(), "hicache_hits_total") - total(metrics, "hicache_hits_total")
    assert hits >= 4, hits


def test_a_sidecar_sigkilled_mid_run_costs_only_recomputation_and_hits_return(stack: Stack) -> None:
    b = prompt(300, 160)
    before = stack.used_pages()
    stack.generate(b)
    stack.wait_held(before, 4)  # and written through to Redis
    time.sleep(2)
    stack.project("kill", "-s", "SIGKILL", "hicache")
    for seed in (301, 302):
        stack.generate(prompt(seed, 100))
    stack.sglang.flush()
    assert stack.generate(b)["storage"] == 0  # the sidecar is gone: computed
    stack.project("up", "-d", "--wait", "hicache", timeout=300)
    for seed in range(310, 330):  # the adapter registers again once the sidecar answers
        stack.generate(prompt(seed, 64))
        if stack.used_pages() > 0:
            break
    else:
        raise AssertionError("SGLang stored nothing in the restarted sidecar")
    stack.sglang.flush()
    assert stack.generate(b)["storage"] >= 4 * PAGE  # stored before the kill: from Redis
