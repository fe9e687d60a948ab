"""A HIT stays loadable: vLLM 0.33's OffloadingConnectorWorker asserts that every load job
succeeded (it has no failure path), so the manager pins a chunk's pages before it answers
HIT, a load shares those pins until complete_load, and they go once the answer has expired
and no load holds them. Also: expedited loads do not queue behind regular ones."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from vllm_env import require_vllm

require_vllm()

import torch  # noqa: E402
from sidecar_util import start_sidecar  # noqa: E402
from test_vllm_offload import CTX, blocks_of, chunk_keys, qwen_engine, resolve, store  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext, TransferResult  # noqa: E402
from vllm_env import FIXTURES, Engine, sidecar_dir  # noqa: E402

from hicache.api import KeyStatus, PrefetchOutcome, Tier  # noqa: E402
from hicache.api import LookupResult as PageLookup  # noqa: E402
from hicache.integrations.vllm import manager as manager_module  # noqa: E402
from hicache.integrations.vllm.keys import chunk_page_keys  # noqa: E402
from hicache.integrations.vllm.manager import HiCacheLoadStoreSpec  # noqa: E402


@pytest.fixture
def sidecar() -> Iterator[str]:
    for d in sidecar_dir():
        proc, target = start_sidecar(d, "--hicache-storage-backend", "none", config=FIXTURES / "qwen3_8b.json")
        yield target
        proc.terminate()
        proc.wait(timeout=60)


@contextmanager
def managed(tmp_path: Path, sidecar: str, **options: Any) -> Iterator[tuple[Engine, Any]]:
    """A Qwen engine on `sidecar` and its manager, both closed afterwards."""
    eng = qwen_engine(tmp_path, sidecar, **options)
    manager = eng.spec.get_manager()
    try:
        yield eng, manager
    finally:
        manager.shutdown()
        eng.close()


def pages(keys: list[bytes]) -> list[bytes]:
    return [p for k in keys for p in chunk_page_keys(k, 1)]


def sidecar_pins(eng: Engine, want: int) -> int:
    """The sidecar's pinned pages of the engine's pool, once they are `want` (unpins run on the
    manager's lookup thread) or 10 s have passed."""
    client, pool = eng.worker.client, eng.worker.links[0].pool_id
    deadline = time.monotonic() + 10
    while (n := client.stats(pool)[0].pinned_pages) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def test_a_hit_evicted_under_pressure_still_loads_through_vllms_connector(tmp_path: Path, sidecar: str) -> None:
    with managed(tmp_path, sidecar) as (eng, manager):
        keys = chunk_keys(2, seed=3)
        want = blocks_of(eng, [1, 2])
        assert store(eng, manager, keys, [1, 2], job=1).success
        assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
        client, pool = eng.worker.client, eng.worker.links[0].pool_id
        assert set(client.evict(pages(keys), pool=pool).statuses) == {KeyStatus.BUSY}  # pinned by the HIT
        with manager.lock:
            src = manager.prepare_load(keys, CTX)
        eng.connector._load_jobs[7] = CTX.req_id  # what start_kv_transfers records for an async load
        eng.raw.zero_()
        eng.worker.submit_load(7, src, GPULoadStoreSpec([5, 6], group_sizes=[2], block_indices=[0]))
        eng.worker.wait({7})
        assert eng.connector.get_finished(set()) == (set(), {CTX.req_id})  # vLLM asserts success
        assert all(torch.equal(a, b) for a, b in zip(want, blocks_of(eng, [5, 6]), strict=True))
        with manager.lock:
            manager.complete_load(keys, CTX)
            manager.reset_cache()  # drops the answers: nothing holds the pins now
        assert sidecar_pins(eng, 0) == 0


def test_a_chunk_whose_pin_fails_is_a_miss_and_keeps_no_pin(
    tmp_path: Path, sidecar: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with managed(tmp_path, sidecar) as (eng, manager):
        keys = chunk_keys(3, seed=4)
        assert store(eng, manager, keys, [1, 2, 3], job=1).success
        client, pool = eng.worker.client, eng.worker.links[0].pool_id
        pin = manager.client.pin

        def evict_then_pin(part: list[bytes], *, pool: str) -> Any:  # chunk 1 goes between Lookup and Pin
            client.evict(pages(keys[1:2]), pool=pool)
            return pin(part, pool=pool)

        monkeypatch.setattr(manager.client, "pin", evict_then_pin)
        assert resolve(manager, keys)[3:] == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
        assert sidecar_pins(eng, 2) == 2 and manager.pinned_pages() == 2  # chunk 2's page: pinned, then unpinned
        assert client.lookup(pages(keys), pool=pool).prefix_length == 1


def test_an_answer_no_load_uses_unpins_when_it_expires_even_without_a_step(tmp_path: Path, sidecar: str) -> None:
    with managed(tmp_path, sidecar, lookup_ttl_s=0.2) as (eng, manager):
        keys = chunk_keys(2, seed=5)
        assert store(eng, manager, keys, [1, 2], job=1).success
        assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
        with manager.lock:
            manager.on_schedule_end(None)  # the pass that saw the answers ends: their TTL runs
        assert eng.worker.client.stats(eng.worker.links[0].pool_id)[0].pinned_pages == 2
        assert sidecar_pins(eng, 0) == 0  # no call from vLLM meanwhile
        assert manager.pinned_pages() == 0


def test_an_answer_outlives_a_step_longer_than_its_ttl_until_a_pass_has_seen_it(
    tmp_path: Path, sidecar: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under vLLM's real server on a busy CPU a step took longer than lookup_ttl_s: answers that
    arrived during it had expired by the next pass, which deferred their requests again (AIPerf
    on Mooncake's trace: every waiting request deferred, the engine idle)."""
    with managed(tmp_path, sidecar, lookup_ttl_s=0.2) as (eng, manager):
        keys = chunk_keys(2, seed=6)
        assert store(eng, manager, keys, [1, 2], job=1).success
        assert resolve(manager, keys)[:2] == [LookupResult.RETRY] * 2
        time.sleep(0.5)  # the step that runs while the answers arrive
        with manager.lock:
            assert [manager.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 2
            manager.on_schedule_end(None)
        assert manager.pinned_pages() == 2
        assert sidecar_pins(eng, 0) == 0  # lookup_ttl_s after that pass, with no step since
        with manager.lock:
            assert [manager.lookup(k, CTX) for k in keys] == [LookupResult.RETRY] * 2
        monkeypatch.setattr(manager_module, "MAX_STEP_S", 0.3)
        assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
        assert sidecar_pins(eng, 0) == 0  # no pass ever sees them (an idle engine): MAX_STEP_S
        assert manager.pinned_pages() == 0


def test_complete_load_releases_only_the_pins_its_own_load_holds(tmp_path: Path, sidecar: str) -> None:
    with managed(tmp_path, sidecar) as (eng, manager):
        a, b = ReqContext(req_id="a"), ReqContext(req_id="b")
        keys = chunk_keys(2, seed=6)
        assert store(eng, manager, keys, [1, 2], job=1).success
        assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
        with manager.lock:
            manager.prepare_load(keys, a)
            manager.reset_cache()  # the answers go; request a's load keeps the pages pinned
            manager.prepare_load(keys, b)  # holds no pin (logged): it must not take a's
            manager.complete_load(keys, b)
        assert sidecar_pins(eng, 2) == 2
        with manager.lock:
            manager.complete_load(keys, a)
        assert sidecar_pins(eng, 0) == 0


def test_complete_load_finds_its_load_whatever_order_its_keys_come_in(tmp_path: Path, sidecar: str) -> None:
    """vLLM's scheduler hands prepare_load a list of chunk keys and complete_load the set of
    them (TransferJobStatus.keys): measured under its real server, a load of a 48-chunk
    document kept its pins forever, and the host tier filled with pinned pages."""
    with managed(tmp_path, sidecar) as (eng, manager):
        a, b = ReqContext(req_id="a"), ReqContext(req_id="b")
        keys = chunk_keys(6, seed=8)
        assert store(eng, manager, keys, [1, 2, 3, 4, 5, 6], job=1).success
        assert resolve(manager, keys)[6:] == [LookupResult.HIT] * 6
        with manager.lock:
            manager.prepare_load(keys, a)
            manager.prepare_load(keys, b)
            manager.reset_cache()  # the answers go: only the two loads hold the pins
            manager.complete_load(set(keys), a)  # as vLLM's scheduler calls it
            manager.complete_load(keys[::-1], b)
        assert sidecar_pins(eng, 0) == 0 and manager.pinned_pages() == 0


def test_a_used_answer_lets_go_of_its_pins_at_the_end_of_the_step(tmp_path: Path, sidecar: str) -> None:
    """From the end of the step, the load that used a HIT answer alone holds its pins, and they
    go when it completes, not lookup_ttl_s later: under vLLM's real server, a small host tier
    held the last two documents' pages pinned, and the next document's prefetch found no room."""
    with managed(tmp_path, sidecar, lookup_ttl_s=60) as (eng, manager):
        keys = chunk_keys(2, seed=9)
        assert store(eng, manager, keys, [1, 2], job=1).success
        assert resolve(manager, keys)[2:] == [LookupResult.HIT] * 2
        with manager.lock:
            manager.prepare_load(keys, CTX)
            manager.on_schedule_end(None)
        assert sidecar_pins(eng, 2) == 2 and manager.pinned_pages() == 2  # the load's
        with manager.lock:
            manager.complete_load(set(keys), CTX)
        assert sidecar_pins(eng, 0) == 0 and manager.pinned_pages() == 0
        with manager.lock:  # the used answer is gone: the next lookup asks the sidecar
            assert manager.lookup(keys[0], CTX) is LookupResult.RETRY


def test_a_chunk_whose_prefetch_brings_nothing_in_time_is_a_miss_and_pins_nothing(
    tmp_path: Path, sidecar: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with managed(tmp_path, sidecar) as (eng, manager):
        client, pool = eng.worker.client, eng.worker.links[0].pool_id
        keys = chunk_keys(2, seed=10)
        assert store(eng, manager, keys, [1, 2], job=1).success
        # the sidecar has no storage tier here: a Lookup that says STORAGE, and a Prefetch that
        # brings nothing before its timeout (NOT_FOUND: cancelled)
        monkeypatch.setattr(manager.client, "lookup", lambda part, **kw: PageLookup(0, (Tier.STORAGE,) * len(part)))
        monkeypatch.setattr(
            manager.client, "prefetch", lambda part, **kw: PrefetchOutcome((KeyStatus.NOT_FOUND,) * len(part))
        )
        assert resolve(manager, keys)[2:] == [LookupResult.MISS] * 2
        assert client.stats(pool)[0].pinned_pages == 0 and manager.pinned_pages() == 0


def test_chunks_asked_again_while_they_are_resolved_are_not_resolved_and_pinned_twice(
    tmp_path: Path, sidecar: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks every step while a request waits: lookups made while the first resolution is
    on the sidecar answer RETRY, and once it publishes they are answered too. Under vLLM's
    real server they were resolved again, and the second answer's pins (never used by a load)
    held the document's pages for lookup_ttl_s."""
    eng = qwen_engine(tmp_path, sidecar, lookup_ttl_s=60)
    manager = eng.spec.get_manager()
    go, ask = threading.Event(), manager._ranks.ask
    try:
        keys = chunk_keys(2, seed=11)
        assert store(eng, manager, keys, [1, 2], job=1).success
        monkeypatch.setattr(manager._ranks, "ask", lambda *a: (go.wait(30), ask(*a))[1])
        for _ in range(2):  # two steps: the second while the first step's resolution is held
            with manager.lock:
                assert [manager.lookup(k, CTX) for k in keys] == [LookupResult.RETRY] * 2
                manager.on_schedule_end(None)
        go.set()
        deadline = time.monotonic() + 30
        while manager.has_pending_work() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not manager.has_pending_work()  # nothing left to resolve
        with manager.lock:
            assert [manager.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 2
            manager.prepare_load(keys, CTX)
            manager.on_schedule_end(None)
            manager.complete_load(set(keys), CTX)
        assert sidecar_pins(eng, 0) == 0 and manager.pinned_pages() == 0
    finally:
        go.set()
        manager.shutdown()
        eng.close()


def test_an_expedited_load_does_not_wait_behind_regular_loads(
    tmp_path: Path, sidecar: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = qwen_engine(tmp_path, sidecar)
    worker = eng.worker
    release = threading.Event()

    def run(job_id: int, moves: Any, store: bool, ready: Any = None) -> tuple[TransferResult, list[int]]:
        if job_id == 1:  # a long regular load
            release.wait(30)
        return TransferResult(job_id, True, 0, 0.0), []

    monkeypatch.setattr(worker, "_run", run)
    try:
        slow, urgent = (HiCacheLoadStoreSpec([k]) for k in chunk_keys(2, seed=7))
        worker.submit_load(1, slow, GPULoadStoreSpec([3], group_sizes=[1], block_indices=[0]))
        worker.submit_load(2, urgent, GPULoadStoreSpec([4], group_sizes=[1], block_indices=[0]), expedited=True)
        start = time.monotonic()
        worker.wait({2})  # what vLLM does within the step
        assert time.monotonic() - start < 5
        assert [r.job_id for r in worker.get_finished()] == [2]
    finally:
        release.set()
        eng.close()
