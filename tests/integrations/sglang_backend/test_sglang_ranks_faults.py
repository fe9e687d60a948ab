"""The SGLang adapter across TP ranks (MHA and MLA), hybrid models (v2), a sidecar that dies or
restarts, and the start-up refusals."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from sglang_env import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
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
from test_sglang_backend import alloc, mimo_full, pages_of, stop, wait_stored  # noqa: E402

from hicache.client import HiCacheRpcError, RegisteredPool  # noqa: E402
from hicache.geometry import model_geometries  # noqa: E402


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def sidecar(sockdir: str, model: str, *extra: str) -> tuple[Any, str]:
    return start_sidecar(sockdir, *extra, config=FIXTURES / f"{model}.json", page_size=16)


def mla_ranks(tmp_path: Path, target: str, layout: str, allocator: str) -> tuple[list[Any], list[Any]]:
    """DeepSeek-V3's host pools of TP ranks 0 and 1, and an SGLang backend over each."""
    name = model_dir(tmp_path, "deepseek_v3")
    pools = [mla_host_pool(61, layout=layout, allocator=allocator) for _ in (0, 1)]
    backends = [
        create(storage_config(name, target, layout=layout, tp=(r, 2), mla=True, allocator=allocator), pools[r])
        for r in (0, 1)
    ]
    return pools, backends


def test_two_tp_ranks_never_share_a_page(tmp_path: Path, sockdir: str) -> None:
    proc, target = sidecar(sockdir, "llama_3_1_8b", "--tp-size", "2")
    try:
        name = model_dir(tmp_path, "llama_3_1_8b")
        ranks = []
        for r in (0, 1):
            pool = mha_host_pool(32, 4, 128, 128, layout="page_first")
            ranks.append((pool, create(storage_config(name, target, layout="page_first", tp=(r, 2)), pool)))
        keys = keys_for(list(range(2 * 16)))
        (p0, b0), (p1, b1) = ranks
        fill(p0, seed=10)
        fill(p1, seed=11)
        i0, i1 = alloc(p0, 2), alloc(p1, 2)
        assert b0.batch_set_v1(keys, i0) == [True, True]
        assert b1.batch_exists(keys) == 0  # rank 0's heads are not rank 1's
        assert b1.batch_set_v1(keys, i1) == [True, True]
        want0, want1 = [page_bytes(p0, p) for p in pages_of(i0)], [page_bytes(p1, p) for p in pages_of(i1)]
        assert want0 != want1
        for pool, backend, want in ((p0, b0, want0), (p1, b1, want1)):
            wait_stored(backend, 2)
            link = backend.links["kv"]
            backend.client.evict(num_pages=link.host_pages, pool=link.pool_id)  # storage only from here
            dst = alloc(pool, 2)
            assert backend.batch_get_v1(keys, dst) == [True, True]
            assert [page_bytes(pool, p) for p in pages_of(dst)] == want
        for _, b in ranks:
            b.close()
    finally:
        stop(proc)


@pytest.mark.parametrize(("layout", "allocator"), [("page_first", "default"), ("layer_first", "shm")])
def test_mla_writer_writes_and_every_rank_reads(tmp_path: Path, sockdir: str, layout: str, allocator: str) -> None:
    proc, target = sidecar(sockdir, "deepseek_v3", "--tp-size", "2")
    try:
        pools, backends = mla_ranks(tmp_path, target, layout, allocator)
        assert all(b.links["kv"].direct == (allocator == "shm") for b in backends)
        assert [b.storage_config.is_storage_writer for b in backends] == [True, False]
        keys = keys_for(list(range(3 * 16)))
        fill(pools[1], seed=21)
        assert backends[1].batch_set_v1(keys, alloc(pools[1], 3)) == [True] * 3  # not the writer: stores nothing
        assert backends[1].batch_exists(keys) == 0 and backends[0].batch_exists(keys) == 0
        fill(pools[0], seed=20)
        src = alloc(pools[0], 3)
        want = [page_bytes(pools[0], p) for p in pages_of(src)]
        assert backends[0].batch_set_v1(keys, src) == [True] * 3
        wait_stored(backends[0], 3)
        for pool, backend in zip(pools, backends, strict=True):
            assert backend.batch_exists(keys) == 3
            dst = alloc(pool, 3)
            assert backend.batch_get_v1(keys, dst) == [True] * 3
            assert [page_bytes(pool, p) for p in pages_of(dst)] == want
        for b in backends:
            b.close()
    finally:
        stop(proc)


@pytest.mark.parametrize("cp", ["dcp", "attn_cp"])
def test_mla_context_parallel_ranks_never_read_each_others_slice(tmp_path: Path, sockdir: str, cp: str) -> None:
    """Under decode or attention CP each rank holds a different slice of every MLA page."""
    proc, target = sidecar(sockdir, "deepseek_v3", "--tp-size", "2")
    try:
        name = model_dir(tmp_path, "deepseek_v3")
        pools = [mla_host_pool(61, layout="page_first") for _ in (0, 1)]
        shard = {"dcp": {"dcp_size": 2, "logical_page_size": 16}, "attn_cp": {"attn_cp_size": 2}}[cp]
        backends = [
            create(
                replace(
                    storage_config(name, target, layout="page_first", tp=(r, 2), mla=True),
                    **shard,
                    **{f"{cp}_rank": r},
                ),
                pools[r],
            )
            for r in (0, 1)
        ]
        keys = keys_for(list(range(2 * 16)))
        fill(pools[0], seed=30)
        fill(pools[1], seed=31)
        assert backends[0].batch_set_v1(keys, alloc(pools[0], 2)) == [True, True]
        wait_stored(backends[0], 2)
        dst = alloc(pools[1], 2)
        before = [page_bytes(pools[1], p) for p in pages_of(dst)]
        assert backends[1].batch_exists(keys) == 0  # rank 0's slice is not rank 1's
        assert backends[1].batch_get_v1(keys, dst) == [False, False]
        assert [page_bytes(pools[1], p) for p in pages_of(dst)] == before
        if cp == "dcp":  # each DCP rank is a writer: rank 1 reads back its own slice
            src = alloc(pools[1], 2)
            want = [page_bytes(pools[1], p) for p in pages_of(src)]
            assert backends[1].batch_set_v1(keys, src) == [True, True]
            wait_stored(backends[1], 2)
            assert backends[1].batch_get_v1(keys, dst) == [True, True]
            assert [page_bytes(pools[1], p) for p in pages_of(dst)] == want
        for b in backends:
            b.close()
    finally:
        stop(proc)


@pytest.mark.parametrize(("layout", "allocator"), [("page_first", "default"), ("layer_first", "shm")])
def test_mla_reader_ranks_hit_the_writers_pages_in_host_memory_without_a_storage_tier(
    tmp_path: Path, sockdir: str, layout: str, allocator: str
) -> None:
    """Both ranks of one node register one identity with one sidecar: they share its host
    cache, so rank 1 reads what rank 0 (SGLang's only MLA writer) stored, with no storage tier."""
    proc, target = sidecar(sockdir, "deepseek_v3", "--tp-size", "2", "--hicache-storage-backend", "none")
    try:
        pools, backends = mla_ranks(tmp_path, target, layout, allocator)
        stats = [b.client.stats(pool=b.links["kv"].pool_id)[0] for b in backends]
        assert stats[0].cache_id == stats[1].cache_id and stats[0].cache_members == 2
        keys = keys_for(list(range(3 * 16)))
        fill(pools[0], seed=30)
        src = alloc(pools[0], 3)
        want = [page_bytes(pools[0], p) for p in pages_of(src)]
        assert backends[0].batch_set_v1(keys, src) == [True] * 3
        fill(pools[1], seed=31)
        assert backends[1].batch_exists(keys) == 3
        dst = alloc(pools[1], 3)
        assert backends[1].batch_get_v1(keys, dst) == [True] * 3
        assert [page_bytes(pools[1], p) for p in pages_of(dst)] == want
        for b in backends:
            b.close()
    finally:
        stop(proc)


def test_mla_reader_ranks_on_other_nodes_refuse_a_sidecar_without_storage(
    tmp_path: Path, sockdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across nodes (SGLang's --nnodes 2) a reader rank's sidecar never sees the writer's host
    pages: without a storage tier it would never hit, and SGLang takes the smallest hit over
    its TP ranks, so no prefix would ever hit."""
    from hicache.integrations.sglang import backend as sglang_backend

    monkeypatch.setattr(sglang_backend, "sglang_nodes", lambda: 2)
    proc, target = sidecar(sockdir, "deepseek_v3", "--tp-size", "2", "--hicache-storage-backend", "none")
    try:
        name = model_dir(tmp_path, "deepseek_v3")
        for r in (0, 1):
            cfg = storage_config(name, target, layout="page_first", tp=(r, 2), mla=True)
            with pytest.raises(ValueError, match="MLA with tp_size 2 over 2 nodes needs a storage tier.*'none'"):
                create(cfg, mla_host_pool(61, layout="page_first"))
        one = create(
            storage_config(name, target, layout="page_first", mla=True), mla_host_pool(61, layout="page_first")
        )
        one.close()  # one rank writes what it reads: no storage tier needed
    finally:
        stop(proc)


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective", "write_through"])
def test_mla_with_reader_ranks_warns_of_a_write_policy_that_stores_late(
    tmp_path: Path, sockdir: str, policy: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache.integrations.sglang import backend as sglang_backend

    monkeypatch.setattr(sglang_backend, "sglang_nodes", lambda: 2)  # the storage tier matters across nodes
    proc, target = sidecar(sockdir, "deepseek_v3", "--tp-size", "2", "--hicache-write-policy", policy)
    try:
        name = model_dir(tmp_path, "deepseek_v3")
        with caplog.at_level("WARNING", logger="hicache.integrations.sglang"):
            backend = create(
                storage_config(name, target, layout="page_first", tp=(1, 2), mla=True),
                mla_host_pool(61, layout="page_first"),
            )
        backend.close()
        late = [r.getMessage() for r in caplog.records if "reach its storage tier late" in r.getMessage()]
        if policy == "write_through":
            assert late == []
        else:
            assert len(late) == 1 and f"--hicache-write-policy {policy}" in late[0]
            assert "start it with --hicache-write-policy write_through" in late[0]
    finally:
        stop(proc)


def test_hybrid_full_and_swa_pools_through_v2(tmp_path: Path, sockdir: str) -> None:
    proc, target = sidecar(sockdir, "mimo_v2_flash")
    try:
        g = model_geometries(
            json.loads((FIXTURES / "mimo_v2_flash.json").read_text()), tp_size=1, page_size=16, dtype="bf16"
        )
        kv, swa = (
            mimo_full("page_first"),
            mha_host_pool(g["swa"].layer_num, g["swa"].head_num, 192, 128, layout="page_first"),
        )
        backend = create(storage_config(model_dir(tmp_path, "mimo_v2_flash"), target, layout="page_first"), kv)
        backend.register_mem_host_pool_v2(kv, PoolName.KV)
        backend.register_mem_host_pool_v2(swa, PoolName.SWA)
        backend.on_host_pools_registered()
        assert backend.links["swa"].geometry == g["swa"] and backend.links["kv"].geometry == g["full"]
        fill(kv, seed=30)
        fill(swa, seed=31)
        keys = keys_for(list(range(3 * 16)))
        ki, si = alloc(kv, 3), alloc(swa, 1)
        assert backend.batch_set_v1(keys, ki) == [True] * 3
        # SWA keeps only the window: the last page of the prefix
        out = backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=si, keys=keys[2:])])
        assert out == {"swa": [True]}
        trailing = [PoolTransfer(name=PoolName.SWA, keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        res = backend.batch_exists_v2(keys, trailing)
        assert res.kv_hit_pages == 3 and res.extra_pool_hit_pages == {"kv": 3, "swa": 3}
        whole = [PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
        assert backend.batch_exists_v2(keys, whole).kv_hit_pages == 0  # SWA pages 0-1 were never stored
        want = page_bytes(swa, pages_of(si)[0])
        fill(swa, seed=32)
        di = alloc(swa, 1)
        got = backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=di, keys=keys[2:])])
        assert got == {"swa": [True]} and page_bytes(swa, pages_of(di)[0]) == want
        backend.close()
    finally:
        stop(proc)


@pytest.mark.parametrize("allocator", ["default", "shm"], ids=["engine", "direct"])
def test_sidecar_down_then_restarted_gives_misses_never_exceptions(
    tmp_path: Path, sockdir: str, allocator: str
) -> None:
    proc, target = sidecar(sockdir, "mimo_v2_flash")
    try:
        pool = mimo_full("page_first_direct", allocator=allocator)
        cfg = storage_config(
            model_dir(tmp_path, "mimo_v2_flash"), target, layout="page_first_direct", timeout_s=30, allocator=allocator
        )  # 30 s: the first registration loads torch in the sidecar (over 2 s once on a busy 2-core
        # machine); a dead sidecar fails at once anyway
        backend = create(cfg, pool)
        fill(pool, seed=40)
        keys = keys_for(list(range(2 * 16)))
        src = alloc(pool, 2)
        want = [page_bytes(pool, p) for p in pages_of(src)]
        assert backend.batch_set_v1(keys, src) == [True, True]
        wait_stored(backend, 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        dst = alloc(pool, 2)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, dst) == [False, False]
        assert backend.batch_set_v1(keys_for(list(range(500, 516))), alloc(pool, 1)) == [False]
        assert backend.batch_exists_v2(keys, []).kv_hit_pages == 0
        proc, _ = sidecar(sockdir, "mimo_v2_flash")  # same socket, same file tier
        deadline = time.monotonic() + 60
        while backend.batch_exists(keys) != 2:  # the first answers are misses while it re-registers
            assert time.monotonic() < deadline, "the adapter never found the restarted sidecar"
            time.sleep(0.1)
        assert backend.batch_get_v1(keys, dst) == [True, True]
        assert [page_bytes(pool, p) for p in pages_of(dst)] == want
        backend.close()
    finally:
        stop(proc)


def test_a_failed_re_registration_is_tried_again_by_any_call(tmp_path: Path, sockdir: str) -> None:
    proc, target = sidecar(sockdir, "mimo_v2_flash")
    try:
        pool = mimo_full("page_first")
        cfg = storage_config(model_dir(tmp_path, "mimo_v2_flash"), target, layout="page_first", timeout_s=30)
        backend = create(cfg, pool)
        link = backend.links["kv"]
        stale = link.pool_id
        proc = restart(proc, sockdir)
        register, fails = link._register, [1]

        def flaky() -> RegisteredPool:  # the restarted sidecar refuses the first re-registration
            if fails:
                fails.pop()
                raise HiCacheRpcError(grpc.StatusCode.UNAVAILABLE, "flapped")
            return register()

        link._register = flaky  # type: ignore[method-assign]
        keys = keys_for(list(range(16)))
        deadline = time.monotonic() + 60
        while fails:  # misses until the new sidecar serves; its NOT_FOUND re-registers, which fails
            assert backend.batch_exists(keys) == 0
            assert time.monotonic() < deadline, "the adapter never found the restarted sidecar"
            time.sleep(0.05)
        assert link.pool_id == stale
        # a store (not only a lookup) finds the pool forgotten and registers again
        src = alloc(pool, 1)
        deadline = time.monotonic() + 30
        while backend.batch_set_v1(keys, src) != [True]:
            assert time.monotonic() < deadline, "stores never re-registered the pool"
            time.sleep(0.05)
        assert link.pool_id != stale
        backend.close()
    finally:
        stop(proc)


def restart(proc: Any, sockdir: str) -> Any:
    """Kill the sidecar and start another on the same socket (it forgets every pool)."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return sidecar(sockdir, "mimo_v2_flash")[0]


def test_a_geometry_mismatch_fails_start_up_naming_the_field(tmp_path: Path, sockdir: str) -> None:
    proc, target = sidecar(sockdir, "mimo_v2_flash")
    try:
        pool = mha_host_pool(9, 4, 192, 192, layout="page_first")  # V sized with K's dim: the old bug
        with pytest.raises(ValueError, match=r"v_head_dim \(engine 192, sidecar 128\)"):
            create(storage_config("not-a-local-model", target, layout="page_first"), pool)
        with pytest.raises(ValueError, match=r"v_head_dim \(SGLang 192, model config 128\)"):
            create(storage_config(model_dir(tmp_path, "mimo_v2_flash"), target, layout="page_first"), pool)
    finally:
        stop(proc)


def test_a_down_sidecar_starts_with_misses_and_bad_layout_or_keys_fail_at_start_up(
    tmp_path: Path, sockdir: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = model_dir(tmp_path, "mimo_v2_flash")
    pool = mimo_full("page_first")
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="hicache.integrations.sglang"):
        backend = create(storage_config(name, f"unix://{sockdir}/nobody.sock", layout="page_first", timeout_s=1), pool)
        keys = keys_for(list(range(16)))
        assert backend.batch_exists(keys) == 0 and backend.batch_get_v1(keys, alloc(pool, 1)) == [False]
        backend.close()
    assert time.monotonic() - t0 < 30  # it does not hang SGLang's start-up
    down = [r.getMessage() for r in caplog.records if "is hicache-server running there" in r.getMessage()]
    assert len(down) == 1  # one warning, then misses
    with pytest.raises(ValueError, match=r"unknown hicache key\(s\) \['targt'\].*'target'"):
        create(storage_config(name, "unix:///x", layout="page_first", targt="y"), pool)
    head = mha_host_pool(2, 4, 128, 128, layout="page_head")
    with pytest.raises(ValueError, match="--hicache-mem-layout one of"):
        create(storage_config(name, "unix:///x", layout="page_head"), head)
    with pytest.raises(ValueError, match="copy .direct. needs SGLang.s host pool in shared memory"):
        create(storage_config(name, "unix:///x", layout="page_first", copy="direct"), pool)


def test_flat_page_methods_on_k_ne_v_are_misses_not_errors(tmp_path: Path, sockdir: str) -> None:
    proc, target = sidecar(sockdir, "mimo_v2_flash")
    try:
        pool = mimo_full("page_first")
        backend = create(storage_config(model_dir(tmp_path, "mimo_v2_flash"), target, layout="page_first"), pool)
        keys = keys_for(list(range(16)))
        assert backend.batch_get(keys) == [None] and backend.get(keys[0]) is None
        assert backend.batch_set(keys, [torch.zeros(4)]) is False and backend.set(keys[0], torch.zeros(4)) is False
        assert backend.batch_set_v1(["not-hex"], alloc(pool, 1)) == [False]
        assert backend.batch_get_v1(keys, torch.arange(5)) == [False]  # slots that are not whole pages
        backend.close()
    finally:
        stop(proc)
