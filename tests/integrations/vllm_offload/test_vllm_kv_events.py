"""vLLM's KV events for what hicache holds: the manager's take_events reports the sidecar's
stores and removals of vLLM's chunks, host pool as Medium.CPU and storage tier as
Medium.STORAGE, and vLLM's own OffloadingEventsTracker turns them into BlockStored /
BlockRemoved with those media. Driven through vLLM's real classes and a live sidecar
started with an admin token (its KV events need it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_env import require_vllm

require_vllm()

from sidecar_util import start_sidecar  # noqa: E402
from test_vllm_offload import chunk_keys, layer_names, store  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    get_offload_block_hash,
)
from vllm_env import FIXTURES, Engine, attention_spec, fill, make_engine, model_dir, sidecar_dir, start_worker  # noqa: E402
from vllm_env import vllm_config as base_vllm_config  # noqa: E402

from hicache.api import EventKind, Tier  # noqa: E402
from hicache.client.health import check_health  # noqa: E402
from hicache.integrations.vllm.events import ChunkResidency, offloading_events  # noqa: E402
from hicache.integrations.vllm.keys import chunk_page_keys  # noqa: E402

ADMIN = "admin-secret"
# (removed, medium, chunk key) of one chunk in one OffloadingEvent
Seen = set[tuple[bool, Medium, bytes]]


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def events_sidecar(sockdir: str, *extra: str) -> tuple[Any, str]:
    return start_sidecar(sockdir, "--admin-token", ADMIN, *extra, config=FIXTURES / "qwen3_8b.json", page_size=16)


def events_engine(tmp: Path, target: str, **extra: Any) -> Engine:
    """qwen3-8b's rank 0 with vLLM's KV events on (--kv-events-config) and hicache's spec."""
    vc = base_vllm_config(model_dir(tmp, "qwen3_8b"), target, admin_token=ADMIN, **extra)
    vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True)
    layers = layer_names(vc.model_config.get_num_layers(vc.parallel_config))
    eng = make_engine(vc, [(attention_spec(vc), layers)], num_blocks=16)
    fill(eng, seed=1)
    return start_worker(eng)


def flatten(events: Any) -> Seen:
    out: Seen = set()
    for e in events:
        assert isinstance(e, OffloadingEvent)
        out |= {(e.removed, e.medium, bytes(k)) for k in e.keys}
    return out


def drain_until(manager: Any, done: Callable[[Seen], bool], seen: Seen | None = None) -> Seen:
    """take_events as vLLM's scheduler calls it each step, until `done(all taken so far)`."""
    seen = set() if seen is None else seen
    deadline = time.monotonic() + 60
    while not done(seen) and time.monotonic() < deadline:
        with manager.lock:
            seen |= flatten(manager.take_events())
        time.sleep(0.02)
    return seen


def external(keys: list[bytes]) -> list[Any]:
    """The block hashes vLLM publishes for these chunks (vLLM's own conversion)."""
    return sorted(maybe_convert_block_hash(BlockHash(get_offload_block_hash(k))) for k in keys)


def stored(keys: list[bytes], medium: Medium) -> Seen:
    return {(False, medium, k) for k in keys}


def removed(keys: list[bytes], medium: Medium) -> Seen:
    return {(True, medium, k) for k in keys}


# ---- ChunkResidency: the state behind take_events, without a sidecar ----------------------------
def test_a_chunk_is_held_once_every_rank_holds_every_page_and_gone_with_any_page() -> None:
    res = ChunkResidency(blocks_per_chunk=2, world_size=2)
    a, b = chunk_keys(2)
    res.track([a, b])
    res.set_pools({"p0": (0, 0), "p1": (1, 0)})
    pa, pb = chunk_page_keys(a, 2), chunk_page_keys(b, 2)
    res.apply(EventKind.STORED, "p0", Tier.HOST, pa + pb)
    res.apply(EventKind.STORED, "p1", Tier.HOST, pa + pb[:1])
    res.apply(EventKind.STORED, "other-engine", Tier.HOST, pb)  # not one of this engine's pools
    assert res.take() == [(False, Tier.HOST, [a])]
    res.apply(EventKind.STORED, "p1", Tier.STORAGE, pa)
    res.apply(EventKind.STORED, "p0", Tier.STORAGE, pa)
    res.apply(EventKind.REMOVED, "p1", Tier.HOST, pa[1:])
    assert res.take() == [(True, Tier.HOST, [a]), (False, Tier.STORAGE, [a])]
    res.apply(EventKind.STORED, "p1", Tier.HOST, pa[1:] + pb[1:])
    res.apply(EventKind.REMOVED, "p0", Tier.HOST, pb)  # b held, then gone, before vLLM drains
    assert res.take() == [(False, Tier.HOST, [a])]  # net changes only: b never showed
    assert res.reported(Tier.HOST) == [a] and res.reported(Tier.STORAGE) == [a]
    res.drop_pool("p0")  # unregistered: nothing it held counts
    assert res.take() == [(True, Tier.HOST, [a]), (True, Tier.STORAGE, [a])]
    res.check_integrity()


def test_vllms_tracker_turns_the_events_into_block_events_with_hicaches_media() -> None:
    res = ChunkResidency(blocks_per_chunk=1, world_size=1)
    keys = chunk_keys(3)
    res.track(keys)
    res.set_pools({"p": (0, 0)})
    pages = [chunk_page_keys(k, 1)[0] for k in keys]
    res.apply(EventKind.STORED, "p", Tier.HOST, pages)
    res.apply(EventKind.STORED, "p", Tier.STORAGE, pages[:2])
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False)
    )
    first = list(tracker.take_events(offloading_events(res.take())))
    assert all(isinstance(e, BlockStored) for e in first)
    hashes = {
        m: sorted(h for e in first if e.medium == m for h in e.block_hashes) for m in (MEDIUM_CPU, MEDIUM_STORAGE)
    }
    assert hashes[MEDIUM_CPU] == external(keys)
    assert hashes[MEDIUM_STORAGE] == external(keys[:2])
    res.apply(EventKind.REMOVED, "p", Tier.HOST, pages[:1])
    (gone,) = tracker.take_events(offloading_events(res.take()))
    assert isinstance(gone, BlockRemoved) and gone.medium == MEDIUM_CPU
    assert gone.block_hashes == external(keys[:1])


def test_a_chunk_forgotten_for_room_is_reported_removed() -> None:
    res = ChunkResidency(blocks_per_chunk=1, world_size=1, max_chunks=2)
    a, b, c = chunk_keys(3)
    res.set_pools({"p": (0, 0)})
    res.track([a, b])
    res.apply(EventKind.STORED, "p", Tier.HOST, chunk_page_keys(a, 1) + chunk_page_keys(b, 1))
    assert res.take() == [(False, Tier.HOST, [a, b])]
    res.track([a, c])  # a used again: b is the oldest, and goes
    assert len(res) == 2 and res.take() == [(True, Tier.HOST, [b])]
    res.apply(EventKind.REMOVED, "p", Tier.HOST, chunk_page_keys(b, 1))  # no longer followed
    assert res.take() == []
    res.check_integrity()


def test_bad_arguments_are_refused_with_their_values() -> None:
    with pytest.raises(ValueError, match="blocks_per_chunk 0"):
        ChunkResidency(blocks_per_chunk=0, world_size=1)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        ChunkResidency(1, 2).set_pools({"p": (2, 0)})


# ---- the manager, a live sidecar and vLLM's worker -----------------------------------------------
def test_stores_and_evictions_in_the_sidecar_reach_take_events_with_their_medium(tmp_path: Path, sockdir: str) -> None:
    proc, target = events_sidecar(sockdir)  # the file tier: pages are written to storage too
    eng = events_engine(tmp_path, target)
    manager = eng.spec.get_manager()
    try:
        first = chunk_keys(3)
        assert store(eng, manager, first, [1, 2, 3], job=1).success
        want = stored(first, Medium.CPU) | stored(first, Medium.STORAGE)
        seen = drain_until(manager, lambda s: want <= s)
        assert seen == want
        # the host pool holds 2 x 16 pages: storing 40 more chunks evicts the first ones from host
        for job, base in enumerate(range(0, 40, 8), start=2):
            assert store(eng, manager, chunk_keys(8, seed=base + 1), list(range(8, 16)), job=job).success
        seen = drain_until(manager, lambda s: removed(first, Medium.CPU) <= s)
        assert removed(first, Medium.CPU) <= seen
        assert not removed(first, Medium.STORAGE) & seen  # still in the file tier
        manager.residency.check_integrity()
    finally:
        manager.shutdown()
        eng.close()
        proc.terminate()
        proc.wait(timeout=60)


def test_an_evict_call_is_a_removal_and_a_restarted_sidecar_is_followed(tmp_path: Path, sockdir: str) -> None:
    proc, target = events_sidecar(sockdir, "--hicache-storage-backend", "none")
    eng = events_engine(tmp_path, target, retry_s=0.2)
    manager = eng.spec.get_manager()
    try:
        keys = chunk_keys(2)
        assert store(eng, manager, keys, [4, 5], job=1).success
        assert drain_until(manager, lambda s: stored(keys, Medium.CPU) <= s) == stored(keys, Medium.CPU)
        pool = eng.worker.links[0].pool_id
        eng.worker.client.evict(chunk_page_keys(keys[0], 1), pool=pool)
        assert drain_until(manager, lambda s: bool(s)) == removed(keys[:1], Medium.CPU)
        proc.terminate()  # the stream breaks: what it held is gone with it
        proc.wait(timeout=60)
        assert drain_until(manager, lambda s: bool(s)) == removed(keys[1:], Medium.CPU)
        with manager.lock:
            assert list(manager.take_events()) == []  # a down sidecar: nothing, and no raise
        proc, _ = events_sidecar(sockdir, "--hicache-storage-backend", "none")
        deadline = time.monotonic() + 60
        while check_health(target) != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        while eng.worker.links[0].pool_id == pool and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker registers again within retry_s
        assert eng.worker.links[0].pool_id != pool
        again = chunk_keys(2, seed=7)
        assert store(eng, manager, again, [6, 7], job=2).success
        assert drain_until(manager, lambda s: stored(again, Medium.CPU) <= s) == stored(again, Medium.CPU)
    finally:
        manager.shutdown()
        eng.close()
        proc.terminate()
        proc.wait(timeout=60)


def test_without_the_admin_token_no_events_and_no_raise(tmp_path: Path, sockdir: str) -> None:
    proc, target = events_sidecar(sockdir)
    vc = base_vllm_config(model_dir(tmp_path, "qwen3_8b"), target)
    vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True)
    eng = make_engine(vc, [(attention_spec(vc), layer_names(vc.model_config.get_num_layers(vc.parallel_config)))])
    start_worker(eng)
    manager = eng.spec.get_manager()
    try:
        assert manager.feed is None
        assert store(eng, manager, chunk_keys(1), [1], job=1).success
        with manager.lock:
            assert list(manager.take_events()) == []
    finally:
        manager.shutdown()
        eng.close()
        proc.terminate()
        proc.wait(timeout=60)
