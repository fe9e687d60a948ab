"""docker-compose.yml under a real Docker engine: the README's `docker compose up`, /metrics on
its published loopback port after the demo engine's run, an engine container that outlives a
SIGKILLed sidecar, and the cluster profile. Without an engine these skip; `make test-compose`
(HICACHE_REQUIRE_DOCKER=1) fails instead."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from .compose_local import ROOT, read_compose
from .docker_project import Project, host_ports, require_docker, scrape, total


@pytest.fixture
def project(request: pytest.FixtureRequest) -> Iterator[Project]:
    require_docker()
    name = "hicache-test-" + request.node.name.removeprefix("test_").replace("_", "-")[:40]
    p = Project(name, **host_ports("HICACHE_METRICS_HOST_PORT"))
    p.down()  # what an interrupted earlier run left
    try:
        yield p
    finally:
        p.down()


def test_docker_compose_up_exits_0(project: Project) -> None:
    r = project("up", "--build", "--abort-on-container-exit", "--exit-code-from", "engine", timeout=1800)
    assert "result: all checks passed" in r.stdout, r.stdout[-4000:]
    storage = next(line for line in r.stdout.splitlines() if "storage tier " in line and "%" in line)
    assert int(storage.split("|")[-1].split()[2]) > 0, storage  # pages came back from Redis


def test_metrics_are_published_on_loopback_and_count_the_demo(project: Project) -> None:
    project("up", "-d", "--build", "--wait", "hicache", timeout=1800)
    host, port = project.published("hicache", 9400)
    assert (host, port) == ("127.0.0.1", int(project.env["HICACHE_METRICS_HOST_PORT"]))
    before = scrape(host, port)
    assert before["hicache_pools"] == 0  # the sidecar serves /metrics before any engine registers
    r = project("run", "--rm", "engine", timeout=600)
    assert "result: all checks passed" in r.stdout, r.stdout[-4000:]
    after = scrape(host, port)
    stored = total(after, "hicache_pages_total", direction="host_to_storage")
    reloaded = total(after, "hicache_pages_total", direction="storage_to_host")
    assert stored > 0 and 0 < reloaded <= stored, (stored, reloaded)  # the demo's pages went to Redis and back


def test_a_running_engine_maps_the_pools_of_a_sidecar_sigkilled_and_started_again(project: Project) -> None:
    project("up", "-d", "--build", "--wait", "hicache", timeout=1800)
    # the engine service's container (its volumes, its /dev/shm), kept running across the
    # sidecar's restart; its demo is run in it before and after
    engine = project("run", "-d", "--entrypoint", "sleep", "engine", "infinity").stdout.strip().splitlines()[-1]
    command = read_compose(ROOT / "docker-compose.yml")["services"]["engine"]["command"]
    demo = ["docker", "exec", engine, "hicache", *command]
    try:
        first = subprocess.run(demo, capture_output=True, text=True, timeout=600)
        assert "result: all checks passed" in first.stdout, first.stdout[-3000:] + first.stderr[-3000:]
        project("kill", "-s", "SIGKILL", "hicache")
        project("up", "-d", "--wait", "hicache", timeout=300)
        again = subprocess.run(demo, capture_output=True, text=True, timeout=600)
        out = again.stdout[-3000:] + again.stderr[-3000:] + project.logs("hicache")[-2000:]
        assert "result: all checks passed" in again.stdout, out
        storage = next(line for line in again.stdout.splitlines() if "storage tier " in line and "%" in line)
        assert int(storage.split()[2]) > 0, out  # pages came back from Redis, through the new sidecar
    finally:
        subprocess.run(["docker", "rm", "-f", engine], capture_output=True, timeout=120)


def test_the_cluster_profile_serves_node_b_from_node_as_pages(project: Project) -> None:
    r = project("--profile", "cluster", "run", "--build", "--rm", "engine-b", timeout=1800)
    assert "result: all checks passed" in r.stdout, r.stdout[-4000:] + project.logs("engine-a")[-3000:]
    cross = next(line for line in r.stdout.splitlines() if "of which another node's" in line)
    assert int(cross.split()[-2]) > 0, r.stdout[-3000:]
