"""SGLang with pipeline parallelism, against its real host pools: a stage's pool holds
layer_num of the model's layers from its start_layer, and the adapter, finding the model
config, registers those layers and no others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_env import require_sglang

require_sglang()

from sglang_env import (  # noqa: E402
    FIXTURES,
    create,
    fill,
    keys_for,
    mha_host_pool,
    model_dir,
    page_bytes,
    sidecar_dir,
    storage_config,
)
from sidecar_util import ROOT  # noqa: E402
from test_sglang_backend import alloc, pages_of, stop, wait_stored  # noqa: E402

LAYERS = json.loads((FIXTURES / "llama_3_1_8b.json").read_text())["num_hidden_layers"]
STAGE = LAYERS // 2  # layers per stage, two stages


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def sidecar_without_model_config(sockdir: str) -> tuple[Any, str]:
    """A sidecar that accepts any geometry: one started with --model-config expects every
    layer of the model in each pool, so it refuses a stage's pool."""
    sock = os.path.join(sockdir, "hc.sock")
    tier = json.dumps({"dir": os.path.join(sockdir, "tier")})
    args = ["--socket", sock, "--page-size", "16", "--hicache-storage-backend-extra-config", tier]
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", *args, "--kv-cache-dtype", "bfloat16", "--log-level", "WARNING"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, f"unix://{sock}"


def stage_pool(start: int, layout: str) -> Any:
    return mha_host_pool(STAGE, 8, 128, 128, layout=layout, start_layer=start)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_each_pipeline_stage_registers_its_own_layers_and_round_trips(
    tmp_path: Path, sockdir: str, layout: str
) -> None:
    proc, target = sidecar_without_model_config(sockdir)
    backends: list[Any] = []
    try:
        name = model_dir(tmp_path, "llama_3_1_8b")
        stages = [stage_pool(start, layout) for start in (0, STAGE)]
        for rank, pool in enumerate(stages):
            backends.append(create(storage_config(name, target, layout=layout, pp=(rank, 2)), pool))
            geometry = backends[-1].links["kv"].geometry
            assert geometry.layer_num == STAGE
            assert geometry.layer_ids == tuple(range(pool.start_layer, pool.start_layer + STAGE))
        keys = keys_for(list(range(2 * 16)))  # every stage stores its own layers of the same pages
        written = []
        for seed, (pool, backend) in enumerate(zip(stages, backends, strict=True)):
            fill(pool, seed=seed + 60)
            src = alloc(pool, 2)
            written.append([page_bytes(pool, p) for p in pages_of(src)])
            assert backend.batch_set_v1(keys, src) == [True, True]
        for pool, backend, want in zip(stages, backends, written, strict=True):
            fill(pool, seed=70)
            dst = alloc(pool, 2)
            assert backend.batch_get_v1(keys, dst) == [True, True]
            assert [page_bytes(pool, p) for p in pages_of(dst)] == want
            # from the file tier too, which both stages share: each gets its own layers back
            wait_stored(backend, 2)
            link = backend.links["kv"]
            assert backend.client.evict(num_pages=link.host_pages, pool=link.pool_id).pages_freed == 2
            fill(pool, seed=71)
            assert backend.batch_get_v1(keys, dst) == [True, True]
            assert [page_bytes(pool, p) for p in pages_of(dst)] == want
    finally:
        for backend in backends:
            backend.close()
        stop(proc)


def test_a_stage_past_the_models_last_layer_fails_start_up_naming_it(tmp_path: Path) -> None:
    pool = mha_host_pool(STAGE, 8, 128, 128, layout="layer_first", start_layer=LAYERS - STAGE // 2)
    cfg = storage_config(model_dir(tmp_path, "llama_3_1_8b"), "unix:///nonexistent/hc.sock", layout="layer_first")
    with pytest.raises(ValueError, match=f"holds {STAGE} layers from layer {LAYERS - STAGE // 2}"):
        create(cfg, pool)
