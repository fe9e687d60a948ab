"""The Python snippets of the README and of docs/ (the pages that continue it: engines, storage
tiers, security) run as written, in order, against the real library and a live in-process
sidecar. The only edits: the sidecar's socket path becomes the test's, and the names a snippet
takes from its surroundings (an engine's device pool, token ids, its own prefix cache and
model) are given real values here."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sidecar_util import filled_device, mimo_full

from hicache.api import KeyStatus
from hicache.cache.config import HiCacheConfig
from hicache.client import HiCacheClient
from hicache.sidecar.config import ServiceConfig
from server import ServerConfig, create_server

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
BLOCKS = [
    textwrap.dedent(b)
    for doc in DOCS
    for b in re.findall(r"^ *```python\n(.*?)^ *```", (ROOT / doc).read_text(), re.S | re.M)
]


def block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"expected one python block in {DOCS} containing {marker!r}, found {len(found)}"
    return found[0]


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    tier = HiCacheConfig(storage_backend="file", extra_config={"dir": str(tmp_path / "tier")})
    srv, address = create_server(ServerConfig(socket=os.path.join(d, "hc.sock"), service=ServiceConfig(hierarchy=tier)))
    yield address
    srv.stop(0)
    shutil.rmtree(d, ignore_errors=True)


def test_every_python_block_is_covered() -> None:
    markers = (
        "json.load(open(",
        "client.pin(keys)",
        "engine_cache.prefix_length",
        "ClientTls(",
        "cfg.build",
    )
    assert len(BLOCKS) == len(markers)
    for m in markers:
        block(m)


def test_library_and_storage_snippets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the snippet opens tests/fixtures/...
    monkeypatch.setenv("HOME", str(tmp_path))  # the file tier's default folder is ~/.cache/hicache
    ns: dict[str, Any] = {}
    exec(block("json.load(open("), ns)
    device, page = ns["device"], ns["page"]
    assert ns["k"].shape[-1] == 192 and ns["v"].shape[-1] == 128
    assert torch.equal(page, device.read_page(3)) and torch.equal(device.read_page(9), device.read_page(3))
    exec(block("cfg.build"), ns)
    assert ns["got"].keys == ns["keys"] and ns["cache"].lookup(ns["keys"]) == ["host", "host"]
    assert torch.equal(device.read_page(2), device.read_page(7))


def test_sidecar_snippet(sidecar: str) -> None:
    dev = filled_device(8, geometry=mimo_full())
    ns: dict[str, Any] = {
        "device_pool": dev,
        "token_ids": list(range(2 * dev.geometry.page_size)),
        "device_pages": [0, 1],
        "other_pages": [5, 6],
    }
    code = block("client.pin(keys)").replace("unix:///run/user/1000/hicache/hicache.sock", sidecar)
    exec(code, ns)
    assert ns["h"].statuses == (KeyStatus.LOADED,) * 2
    assert torch.equal(dev.read_page(5), dev.read_page(0)) and torch.equal(dev.read_page(6), dev.read_page(1))


def test_embedding_snippet(sidecar: str) -> None:
    dev = filled_device(8, geometry=mimo_full())
    page_size = dev.geometry.page_size
    tokens = list(range(3 * page_size + 1))
    # an earlier engine run offloaded the prompt's three pages; they reached the file tier
    with HiCacheClient(sidecar) as earlier:
        earlier.register(dev, namespace="tenant-a", model_id="MiMo-V2-Flash@main")
        assert earlier.offload(earlier.page_keys(tokens), [0, 1, 2]).statuses == (KeyStatus.STORED,) * 3
    forwarded: list[int] = []
    layers = [
        SimpleNamespace(local=i, forward=lambda *a, i=i: forwarded.append(i)) for i in range(dev.geometry.layer_num)
    ]
    ns: dict[str, Any] = {
        "device_pool": dev,
        "tenant": "tenant-a",
        "token_ids": tokens,
        "page_size": page_size,
        "engine_cache": SimpleNamespace(prefix_length=lambda keys: 0, allocate=lambda n: list(range(5, 5 + n))),
        "model": SimpleNamespace(layers=layers),
        "their_device_pages": [],
    }
    exec(block("engine_cache.prefix_length").replace("/run/hicache/hicache.sock", sidecar), ns)
    assert ns["found"].prefix_length == 3 and ns["in_storage"] == ns["hit"]  # host memory went with the old pool
    assert ns["handle"].statuses == (KeyStatus.LOADED,) * 3 and forwarded == list(range(dev.geometry.layer_num))
    for src, dst in zip([0, 1, 2], [5, 6, 7], strict=True):
        assert torch.equal(dev.read_page(dst), dev.read_page(src))
    ns["client"].close()


def test_tls_snippet_names_real_api() -> None:
    code = block("ClientTls(")
    compile(code, "README-tls", "exec")
    from hicache.client import ClientTls, HiCacheClient

    assert ClientTls and HiCacheClient  # the names the snippet imports exist where it imports them
    assert "from hicache.client import ClientTls, HiCacheClient" in code
