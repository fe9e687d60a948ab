"""The SGLang adapter's copy path "engine" (SGLang's host pool outside memfds): this process
copies between SGLang's host buffers and the sidecar's host pool, one copy each way. Its
choice is logged once and shown in stats; a copy that fails or a process killed mid-copy
publishes nothing; bad input is a miss with a reason, never an exception to SGLang."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_env import require_sglang

require_sglang()

import torch  # noqa: E402
from helpers import eventually  # noqa: E402
from sglang_env import (  # noqa: E402
    FIXTURES,
    create,
    fill,
    keys_for,
    mha_host_pool,
    mla_host_pool,
    model_dir,
    page_bytes,
    sidecar_dir,
    storage_config,
)
from sidecar_util import start_sidecar  # noqa: E402
from test_sglang_backend import alloc, assert_host_rows, mimo_full, pages_of, stop, wait_stored  # noqa: E402

from hicache.api import Tier  # noqa: E402
from hicache.client import HiCacheClient  # noqa: E402
from hicache.integrations.sglang.link import page_numbers  # noqa: E402
from hicache.integrations.sglang.options import Options  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def sidecar(sockdir: str, model: str = "mimo_v2_flash", *extra: str) -> tuple[Any, str]:
    return start_sidecar(sockdir, *extra, config=FIXTURES / f"{model}.json", page_size=16)


@pytest.mark.parametrize(
    ("allocator", "copy", "path"),
    [
        ("default", "auto", "engine"),
        ("shm", "auto", "sidecar"),
        ("shm", "engine", "engine"),
        ("shm", "staging", "engine"),  # the former name of "engine" still works
    ],
)
def test_the_copy_path_is_chosen_logged_once_and_shown_in_stats(
    tmp_path: Path, sockdir: str, caplog: pytest.LogCaptureFixture, allocator: str, copy: str, path: str
) -> None:
    proc, target = sidecar(sockdir)
    try:
        pool = mimo_full("page_first", allocator=allocator)
        cfg = storage_config(
            model_dir(tmp_path, "mimo_v2_flash"), target, layout="page_first", allocator=allocator, copy=copy
        )
        with caplog.at_level(logging.INFO, logger="hicache.integrations.sglang"):
            backend = create(cfg, pool)
            fill(pool, seed=7)
            keys = keys_for(list(range(2 * 16)))
            src = alloc(pool, 2)
            assert backend.batch_set_v1(keys, src) == [True, True]
            assert backend.batch_get_v1(keys, alloc(pool, 2)) == [True, True]
        link = backend.links["kv"]
        assert link.copy_path == path and link.direct == (path == "sidecar")
        assert backend.client.stats(pool=link.pool_id)[0].copy_path == path
        said = [r.getMessage() for r in caplog.records if f"copy path '{path}'" in r.getMessage()]
        assert len(said) == 1 and "'kv'" in said[0], said
        backend.close()
    finally:
        stop(proc)


def test_mla_and_its_flat_pages_through_the_engine_copy(tmp_path: Path, sockdir: str) -> None:
    proc, target = sidecar(sockdir, "deepseek_v3", "--tp-size", "2")
    try:
        pool = mla_host_pool(61, layout="layer_first")
        cfg = storage_config(model_dir(tmp_path, "deepseek_v3"), target, layout="layer_first", mla=True)
        backend = create(cfg, pool)
        assert backend.links["kv"].copy_path == "engine"
        fill(pool, seed=30)
        keys = keys_for(list(range(2 * 16)))
        src = alloc(pool, 2)
        want = [page_bytes(pool, p) for p in pages_of(src)]
        assert backend.batch_set_v1(keys, src) == [True, True]
        assert_host_rows(backend, keys, pool, pages_of(src))
        dst = alloc(pool, 2)
        assert backend.batch_get_v1(keys, dst) == [True, True]
        assert [page_bytes(pool, p) for p in pages_of(dst)] == want
        flat_keys = keys_for(list(range(900, 916)))
        flat = pool.get_data_page(int(src[0]), flat=True)
        assert backend.batch_set(flat_keys, [flat]) is True
        assert torch.equal(backend.get(flat_keys[0]), flat)
        backend.close()
    finally:
        stop(proc)


def test_a_copy_that_fails_midway_publishes_nothing_and_gives_its_pages_back(tmp_path: Path, sockdir: str) -> None:
    proc, target = sidecar(sockdir)
    try:
        pool = mimo_full("page_first")
        backend = create(storage_config(model_dir(tmp_path, "mimo_v2_flash"), target, layout="page_first"), pool)
        link = backend.links["kv"]
        copier = backend.client._copiers[link.pool_id]
        engine, writer = copier.engine, copier.writer  # reloads from the host pool, offloads into the window
        fill(pool, seed=8)
        keys = keys_for(list(range(3 * 16)))
        src = alloc(pool, 3)
        want = [page_bytes(pool, p) for p in pages_of(src)]
        offload, reload = writer.offload, engine.reload

        def offload_one_then_fail(device_pages: list[int], host_pages: list[int], **kw: Any) -> int:
            offload(device_pages[:1], host_pages[:1])  # one page is in the sidecar's memory ...
            raise RuntimeError("copy failed midway")  # ... and then the copy fails

        writer.offload = offload_one_then_fail
        assert backend.batch_set_v1(keys, src) == [False] * 3
        assert backend.batch_exists(keys) == 0  # not even the page that was copied
        stats = backend.client.stats(pool=link.pool_id)[0]
        assert stats.used_pages == 0 and stats.tiers[1].pages == 0  # nothing held, nothing stored
        writer.offload = offload
        assert backend.batch_set_v1(keys, src) == [True] * 3

        def fail_reload(*args: Any, **kw: Any) -> int:
            raise RuntimeError("copy failed midway")

        engine.reload = fail_reload
        dst = alloc(pool, 3)
        assert backend.batch_get_v1(keys, dst) == [False] * 3
        engine.reload = reload
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert [page_bytes(pool, p) for p in pages_of(dst)] == want
        wait_stored(backend, 3)  # (pages on their way to the file tier are busy)
        evicted = backend.client.evict(keys=[bytes.fromhex(k) for k in keys], pool=link.pool_id)
        assert evicted.pages_freed == 3  # neither reload holds them any more, the failed one included
        backend.close()
    finally:
        stop(proc)


KILLED_MID_COPY = textwrap.dedent(
    """
    import json, os, sys
    sys.path[:0] = ["tests", "tests/integrations/sglang_backend"]
    from sglang_env import create, fill, keys_for, storage_config
    from test_sglang_backend import alloc, mimo_full
    pool = mimo_full("page_first")
    backend = create(storage_config(sys.argv[2], sys.argv[1], layout="page_first", timeout_s=30), pool)
    link = backend.links["kv"]
    writer = backend.client._copiers[link.pool_id].writer  # offloads go into the pool's window
    offload = writer.offload
    def killed(device_pages, host_pages, **kw):
        offload(device_pages[:1], host_pages[:1])  # one page copied, then the process dies
        print(json.dumps([link.pool_id, link.info.secret]), flush=True)
        os._exit(9)
    writer.offload = killed
    fill(pool, seed=9)
    backend.batch_set_v1(keys_for(list(range(3 * 16))), alloc(pool, 3))
    """
)


def test_an_engine_killed_mid_copy_leaves_nothing_visible_and_its_pool_goes_with_the_lease(
    tmp_path: Path, sockdir: str
) -> None:
    proc, target = sidecar(sockdir, "mimo_v2_flash", "--lease-timeout", "2", "--admin-token", "adm")
    try:
        name = model_dir(tmp_path, "mimo_v2_flash")
        out = subprocess.run(
            [sys.executable, "-c", KILLED_MID_COPY, target, name], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 9, out.stderr[-2000:]
        pool_id, secret = json.loads(out.stdout.strip().splitlines()[-1])
        keys = [bytes.fromhex(k) for k in keys_for(list(range(3 * 16)))]
        with HiCacheClient(target, timeout=10, admin_token="adm") as witness:
            witness.attach(pool_id, secret)
            assert witness.lookup(keys, pool=pool_id).tiers == (Tier.NONE,) * 3  # (a call naming it renews its lease)
            (dead,) = [s for s in witness.stats(all_pools=True) if s.pool_id == pool_id]
            assert dead.used_pages == 0 and dead.tiers[1].pages == 0
            # another SGLang engine of the same model is not served the half-copied pages either
            other = create(storage_config(name, target, layout="page_first"), mimo_full("page_first"))
            assert other.batch_exists(keys_for(list(range(3 * 16)))) == 0
            other.close()
            eventually(
                lambda: pool_id not in [s.pool_id for s in witness.stats(all_pools=True)],
                60,
                "the dead engine's pool going with its lease",
            )
    finally:
        stop(proc)


def test_bad_flat_pages_and_options_are_refused_naming_the_value(tmp_path: Path, sockdir: str) -> None:
    with pytest.raises(
        ValueError, match=r"'copy' must be one of \['auto', 'direct', 'engine', 'staging'\], got 'twice'"
    ):
        Options.parse({"target": "unix:///x", "copy": "twice"})
    proc, target = sidecar(sockdir, "llama_3_1_8b", "--tp-size", "2")
    try:
        pool = mha_host_pool(32, 4, 128, 128, layout="page_first")
        backend = create(
            storage_config(model_dir(tmp_path, "llama_3_1_8b"), target, layout="page_first", tp=(0, 2)), pool
        )
        link = backend.links["kv"]
        keys = keys_for(list(range(2 * 16)))
        page = pool.get_dummy_flat_data_page()
        with pytest.raises(ValueError, match=rf"holds {link.geometry.page_bytes} bytes, got {page.nbytes - 2} "):
            link.set_flat([bytes(32)], [page.view(torch.uint8)[:-2]])
        with pytest.raises(ValueError, match="contiguous CPU tensor, got list"):
            link.get_flat([bytes(32)], [[0] * 8])
        with pytest.raises(ValueError, match="got 2 keys but 1 flat pages"):
            link.set_flat([bytes(32), bytes(32)], [page])
        assert backend.batch_set(keys, [page, page[:-1]]) is False  # SGLang gets a miss, not an exception
        assert backend.batch_exists(keys) == 0  # the good page was not stored either
        assert backend.batch_get(keys, [page, page[::2]]) == [None, None]
        assert backend.client.stats(pool=link.pool_id)[0].used_pages == 0
        with pytest.raises(ValueError, match="do not start each page on a page boundary"):
            page_numbers(torch.arange(3, 3 + 32), 16, 2)
        assert backend.batch_set_v1(keys, torch.arange(3, 3 + 32)) == [False, False]
        backend.close()
    finally:
        stop(proc)
