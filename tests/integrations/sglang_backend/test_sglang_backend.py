"""hicache as SGLang 0.5.23's storage backend, against SGLang's real classes (its factory, host
pools over CPU tensors, get_hash_str keys) and a live hicache-server on a Unix socket."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_env import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang_env import (  # noqa: E402
    FIXTURES,
    create,
    fill,
    keys_for,
    mha_host_pool,
    model_dir,
    page_bytes,
    sglang_rows,
    sidecar_dir,
    storage_config,
)
from sidecar_util import start_sidecar  # noqa: E402

from hicache.geometry import model_geometries  # noqa: E402

MIMO = model_geometries(
    __import__("json").loads((FIXTURES / "mimo_v2_flash.json").read_text()), tp_size=1, page_size=16, dtype="bf16"
)


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def sidecar(sockdir: str, model: str = "mimo_v2_flash", *extra: str) -> tuple[Any, str]:
    return start_sidecar(sockdir, *extra, config=FIXTURES / f"{model}.json", page_size=16)


def stop(proc: Any) -> None:
    proc.terminate()
    proc.wait(timeout=60)


def mimo_full(layout: str, pages: int = 8, allocator: str = "default") -> Any:
    g = MIMO["full"]
    return mha_host_pool(
        g.layer_num, g.head_num, g.head_dim, g.v_head_dim, layout=layout, pages=pages, allocator=allocator
    )


def alloc(pool: Any, n_pages: int) -> torch.Tensor:
    return pool.alloc(n_pages * pool.page_size)


def pages_of(indices: torch.Tensor, page: int = 16) -> list[int]:
    return (indices[::page] // page).tolist()


@pytest.mark.parametrize("allocator", ["default", "shm"], ids=["engine", "direct"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mimo_k192_v128_set_evict_get_is_bit_exact(tmp_path: Path, sockdir: str, layout: str, allocator: str) -> None:
    proc, target = sidecar(sockdir)
    try:
        pool = mimo_full(layout, allocator=allocator)
        assert type(pool).__name__ == "AsymmetricMHATokenToKVPoolHost"
        cfg = storage_config(model_dir(tmp_path, "mimo_v2_flash"), target, layout=layout, allocator=allocator)
        backend = create(cfg, pool)
        link = backend.links["kv"]
        assert link.direct == (allocator == "shm")
        assert backend.client.stats(pool=link.pool_id)[0].copy_path == ("sidecar" if link.direct else "engine")
        fill(pool, seed=1)
        keys = keys_for(list(range(3 * 16)))
        src = alloc(pool, 3)
        before = [page_bytes(pool, p) for p in pages_of(src)]
        assert backend.batch_set_v1(keys, src) == [True] * 3
        assert_host_rows(backend, keys, pool, pages_of(src))  # K 192 and V 128 rows, each where hicache keeps it
        assert backend.batch_exists(keys) == 3
        pool.free(src)  # evicted from SGLang's host pool ...
        fill(pool, seed=2)
        dst = alloc(pool, 3)
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert [page_bytes(pool, p) for p in pages_of(dst)] == before
        # ... and from the sidecar's host memory: the file tier serves them, still exact
        wait_stored(backend, 3)
        assert backend.client.evict(num_pages=link.host_pages, pool=link.pool_id).pages_freed == 3
        fill(pool, seed=3)
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert [page_bytes(pool, p) for p in pages_of(dst)] == before
        backend.close()
    finally:
        stop(proc)


def assert_host_rows(backend: Any, keys: list[str], pool: Any, pages: list[int], name: str = "kv") -> None:
    """Every layer's K and V (or latent) rows of SGLang's host pages `pages` are, bit for bit,
    in the sidecar's host pages of `keys` (hicache's layout, read through the sidecar's own
    shared memory; SGLang's rows indexed by sglang_rows, independently of the adapter)."""
    from hicache.memory import MemoryHandle
    from hicache.pools import HostKVPool

    link = backend.links[name]
    info = link.info
    grant = backend.client.begin_copy([bytes.fromhex(k) for k in keys], offload=False, pool=info.pool_id)
    host = HostKVPool.attach(
        link.geometry, info.host_pages, info.host_layout, MemoryHandle("shm", 0, name=info.host_shm_name)
    )
    try:
        assert len(grant.host_pages) == len(keys)
        for hp, p in zip(grant.host_pages, pages, strict=True):
            for layer in range(pool.layer_num):
                for b, rows in enumerate(sglang_rows(pool, layer, p)):
                    got = host.chunks(b, hp, layer)[0, 0]  # [page_size, row_bytes]
                    assert torch.equal(got, rows.contiguous().view(torch.uint8).reshape(got.shape)), (layer, b)
    finally:
        host.close()
        backend.client.end_copy(grant.grant_id, commit=True, pool=info.pool_id)


def wait_stored(backend: Any, n: int, name: str = "kv") -> None:
    """Until the sidecar's write-through has put n pages in its storage tier (no timing checks:
    this only waits for the background writer)."""
    link = backend.links[name]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = backend.client.stats(pool=link.pool_id)[0]
        if st.storage_write_queue == 0 and st.tiers[1].pages >= n:
            return
        time.sleep(0.05)
    raise AssertionError("the sidecar did not store the pages")


@pytest.mark.parametrize(
    ("layout", "allocator"), [("layer_first", "default"), ("page_first", "shm"), ("page_first_direct", "default")]
)
def test_llama_every_layout_and_flat_pages(tmp_path: Path, sockdir: str, layout: str, allocator: str) -> None:
    proc, target = sidecar(sockdir, "llama_3_1_8b", "--tp-size", "2")
    try:
        pool = mha_host_pool(32, 4, 128, 128, layout=layout, allocator=allocator)
        assert type(pool).__name__ == "MHATokenToKVPoolHost"
        cfg = storage_config(
            model_dir(tmp_path, "llama_3_1_8b"), target, layout=layout, tp=(0, 2), allocator=allocator, staging_pages=2
        )
        backend = create(cfg, pool)
        assert backend.links["kv"].direct == (allocator == "shm")
        fill(pool, seed=4)
        keys = keys_for(list(range(2 * 16)))
        src = alloc(pool, 2)
        before = [page_bytes(pool, p) for p in pages_of(src)]
        assert backend.batch_set_v1(keys, src) == [True, True]
        assert_host_rows(backend, keys, pool, pages_of(src))
        dst = alloc(pool, 2)
        assert backend.batch_get_v1(keys, dst) == [True, True]
        assert [page_bytes(pool, p) for p in pages_of(dst)] == before
        # SGLang without interface_v1: flat pages in and out (3 of them: more than the 2 scratch pages)
        flat_keys = keys_for(list(range(100, 100 + 3 * 16)))
        flat_src = pages_of(alloc(pool, 3))
        flats = [pool.get_data_page(p * 16, flat=True) for p in flat_src]
        assert backend.batch_set(flat_keys, flats) is True
        assert_host_rows(backend, flat_keys, pool, flat_src)
        got = backend.batch_get(flat_keys, [pool.get_dummy_flat_data_page() for _ in flat_keys])
        assert all(torch.equal(g, f) for g, f in zip(got, flats, strict=True)) and backend.exists(flat_keys[0])
        # a flat page stored is the page that interface_v1 loads into SGLang's host pool
        into = alloc(pool, 1)
        assert backend.batch_get_v1(flat_keys[:1], into) == [True]
        assert torch.equal(pool.get_data_page(int(into[0]), flat=True), flats[0])
        backend.close()
    finally:
        stop(proc)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_direct_and_engine_copies_agree_through_storage(tmp_path: Path, sockdir: str, layout: str) -> None:
    """SGLang's memfd pool copied by the sidecar itself and a plain pool copied by this
    process (the engine copy path; the tests above check both row by row) store the same
    pages."""
    proc, target = sidecar(sockdir)
    try:
        name = model_dir(tmp_path, "mimo_v2_flash")
        direct, staged = mimo_full(layout, allocator="shm"), mimo_full(layout)
        bd = create(storage_config(name, target, layout=layout, allocator="shm"), direct)
        bs = create(storage_config(name, target, layout=layout), staged)
        assert bd.links["kv"].direct and not bs.links["kv"].direct
        for writer, reader, wpool, rpool, seed in ((bd, bs, direct, staged, 50), (bs, bd, staged, direct, 51)):
            fill(wpool, seed)
            keys = keys_for(list(range(seed * 1000, seed * 1000 + 2 * 16)))
            src = alloc(wpool, 2)
            assert writer.batch_set_v1(keys, src) == [True, True]
            wait_stored(writer, 2)
            dst = alloc(rpool, 2)  # the reader's own sidecar pool: the pages come from the file tier
            assert reader.batch_get_v1(keys, dst) == [True, True]
            assert [page_bytes(rpool, p) for p in pages_of(dst)] == [page_bytes(wpool, p) for p in pages_of(src)]
        bd.close()
        bs.close()
    finally:
        stop(proc)


def test_batch_exists_counts_the_stored_prefix(tmp_path: Path, sockdir: str) -> None:
    proc, target = sidecar(sockdir)
    try:
        pool = mimo_full("page_first")
        backend = create(storage_config(model_dir(tmp_path, "mimo_v2_flash"), target, layout="page_first"), pool)
        keys = keys_for(list(range(4 * 16)))
        idx = alloc(pool, 4)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys[:2], idx[:32]) == [True, True]
        assert backend.batch_set_v1(keys[3:], idx[48:]) == [True]  # page 3 without page 2
        assert backend.batch_exists(keys) == 2
        assert backend.batch_exists(keys[3:]) == 1 and backend.batch_exists(keys[2:]) == 0
        # a get stops at the first miss: later pages are of no use to SGLang
        assert backend.batch_get_v1(keys, alloc(pool, 4)) == [True, True, False, False]
        backend.close()
    finally:
        stop(proc)
