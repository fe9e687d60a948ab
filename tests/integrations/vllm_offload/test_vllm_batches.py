"""The vLLM manager's calls stay within the sidecar's --max-batch: a step that asks about more
page keys than one call may carry is answered, not turned into misses and refused stores."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_env import require_vllm

require_vllm()

from sidecar_util import start_sidecar  # noqa: E402
from test_vllm_offload import CTX, chunk_keys, qwen_engine, resolve, store  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, make_offload_key  # noqa: E402
from vllm_env import FIXTURES, sidecar_dir  # noqa: E402

from hicache.integrations.vllm import manager as manager_module  # noqa: E402
from hicache.integrations.vllm.batches import BATCH, batches  # noqa: E402
from hicache.integrations.vllm.keys import chunk_page_keys  # noqa: E402


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def sidecar_with_max_batch(sockdir: str, max_batch: int) -> tuple[Any, str]:
    return start_sidecar(sockdir, "--max-batch", str(max_batch), config=FIXTURES / "qwen3_8b.json", page_size=16)


def many_keys(n: int, seed: int) -> list[bytes]:
    return [make_offload_key(seed.to_bytes(2, "big") + i.to_bytes(30, "big"), 0) for i in range(n)]


def test_batches_cut_in_order_and_refuse_a_size_below_one() -> None:
    assert [list(b) for b in batches([1, 2, 3, 4, 5], 2)] == [[1, 2], [3, 4], [5]]
    assert list(batches([], 3)) == []
    with pytest.raises(ValueError, match="got 0"):
        list(batches([1], 0))


def test_a_step_of_more_page_keys_than_the_sidecars_max_batch_is_answered(tmp_path: Path, sockdir: str) -> None:
    proc, target = sidecar_with_max_batch(sockdir, BATCH)  # the smallest --max-batch the adapter serves
    eng = qwen_engine(tmp_path, target)
    manager = eng.spec.get_manager()
    try:
        stored = chunk_keys(2, seed=7)
        assert store(eng, manager, stored, [1, 2], job=1).success
        keys = many_keys(BATCH, seed=1) + stored  # one chunk = one page: BATCH + 2 page keys
        answers = resolve(manager, keys)[len(keys) :]
        assert answers[-2:] == [LookupResult.HIT] * 2  # found past the first Lookup's keys
        assert set(answers[:-2]) == {LookupResult.MISS}
        with manager.lock:  # no call failed: the manager still stores
            assert manager.prepare_store(chunk_keys(1, seed=9), CTX) is not None
    finally:
        manager.shutdown()
        eng.close()
        proc.terminate()
        proc.wait(timeout=60)


def test_prefetch_pin_and_unpin_are_cut_to_the_batch_too(
    tmp_path: Path, sockdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a sidecar and a manager that take 2 keys per call: 3 chunks need two calls of each kind
    monkeypatch.setattr(manager_module, "BATCH", 2)
    proc, target = sidecar_with_max_batch(sockdir, 2)
    eng = qwen_engine(tmp_path, target)
    manager = eng.spec.get_manager()
    client, pool = eng.worker.client, eng.worker.links[0].pool_id
    try:
        keys = chunk_keys(3, seed=5)
        assert store(eng, manager, keys[:2], [4, 5], job=1).success  # the worker's own calls: 2 keys each
        assert store(eng, manager, keys[2:], [6], job=2).success
        pages = [p for k in keys for p in chunk_page_keys(k, 1)]
        deadline = time.monotonic() + 30
        while client.stats(pool)[0].storage_write_queue and time.monotonic() < deadline:
            time.sleep(0.01)
        for part in batches(pages, 2):
            client.evict(list(part), pool=pool)  # host -> gone; the file tier still has them
        with manager.lock:
            manager.reset_cache()
        deadline = time.monotonic() + 30  # Lookups, then Prefetches of 2 + 1 keys bring them back
        while resolve(manager, keys)[3:] != [LookupResult.HIT] * 3 and time.monotonic() < deadline:
            time.sleep(0.06)
        assert resolve(manager, keys)[3:] == [LookupResult.HIT] * 3
        assert manager.pinned_pages() == 3  # the HITs pinned every page, over two Pin calls
        with manager.lock:
            manager.prepare_load(keys, CTX)  # shares those pins
            manager.complete_load(keys, CTX)
            manager.reset_cache()  # the answers go: two Unpin calls
        deadline = time.monotonic() + 30
        while client.stats(pool)[0].pinned_pages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.stats(pool)[0].pinned_pages == 0 and manager.pinned_pages() == 0
        with manager.lock:
            assert manager.prepare_store(chunk_keys(1, seed=9), CTX) is not None  # no call failed
    finally:
        manager.shutdown()
        eng.close()
        proc.terminate()
        proc.wait(timeout=60)
