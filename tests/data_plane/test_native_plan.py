"""The C planning of a large transfer (_native_plan.c): its descriptors are exactly the
chunks of the pages (the numpy reference, chunk_parts), in the promised order; merging stays
within a layer; bad input is refused naming it; and the planning holds the GIL (a busy thread does not slow it)."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
from conftest import load_config

from hicache import DeviceKVPool, HostKVPool, KVGeometry, TransferEngine
from hicache.pools import LAYOUTS
from hicache.transfer import native

pytestmark = pytest.mark.skipif(not native.available(), reason="C extension not built")
C = native._native


def mimo(page_size: int = 4) -> KVGeometry:
    return KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=page_size)


def pools(layout: str, pages: int = 40) -> tuple[DeviceKVPool, HostKVPool, TransferEngine]:
    g = mimo()
    dev, host = DeviceKVPool(g, pages), HostKVPool(g, pages, layout)
    return dev, host, TransferEngine(dev, host, "torch")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("by_layer", [False, True])
@pytest.mark.parametrize("key_is_src", [False, True])
def test_built_descriptors_are_the_chunks_in_stable_key_order(layout, by_layer, key_is_src):
    dev, host, engine = pools(layout)
    rng = np.random.default_rng(3)
    plan = engine.reload_plan(rng.permutation(40)[:17], rng.permutation(40)[:17], [0, 2, 3, 7])
    descs, positions = native._built(host, dev, plan, plan.layers, by_layer=by_layer, key_is_src=key_is_src)
    parts = native.chunk_parts(host, dev, plan, np.asarray(plan.layers, dtype=np.int64))
    reference = np.concatenate(parts)  # (buffer, page, layer) order
    layer_of = np.concatenate([np.tile(np.arange(len(plan.layers)), len(plan.src_pages))] * len(parts))
    key = reference[:, native.SRC if key_is_src else native.DST]
    order = np.lexsort((np.arange(len(key)), key, layer_of if by_layer else np.zeros_like(key)))
    assert np.array_equal(descs, reference[order])
    assert np.array_equal(positions, layer_of[order] if by_layer else np.zeros(len(key), dtype=np.int64))


def test_merge_joins_runs_within_a_layer_only():
    rows = [[0, 1000, 1, 100, 100, 100], [100, 1100, 1, 100, 100, 100], [200, 1200, 1, 100, 100, 100]]
    descs = np.array(rows, dtype=np.int64)
    merged, ends = C.merge_descriptors(descs, np.array([0, 0, 1], dtype=np.int64), 3, 1 << 20)
    out = native._descs(merged)
    assert out[:, [0, 1, 3]].tolist() == [[0, 1000, 200], [200, 1200, 100]]  # not across layers 0 and 1
    assert np.frombuffer(ends, dtype=np.int64).tolist() == [1, 2, 2]  # layer 2 holds nothing
    same, ends = C.merge_descriptors(descs, np.array([0, 0, 1], dtype=np.int64), 2, 0)  # cap 0: no merging
    assert np.array_equal(native._descs(same), descs) and np.frombuffer(ends, dtype=np.int64).tolist() == [2, 3]


def test_bad_arguments_are_refused_naming_them():
    strides = np.zeros((2, 5), dtype=np.int64)
    pages, layers = np.arange(3, dtype=np.int64), np.arange(2, dtype=np.int64)
    with pytest.raises(ValueError, match=r"src_strides must be a C-contiguous int64 array of shape \(n, 5\)"):
        C.build_descriptors(np.zeros((2, 4), dtype=np.int64), strides, 4, pages, pages, layers, False, False)
    with pytest.raises(ValueError, match="dst_pages must be a C-contiguous 1-d int64 array"):
        C.build_descriptors(strides, strides, 4, pages, pages.astype(np.int32), layers, False, False)
    with pytest.raises(ValueError, match="3 and 2 pages"):
        C.build_descriptors(strides, strides, 4, pages, pages[:2], layers, False, False)
    with pytest.raises(ValueError, match="page_size 0"):
        C.build_descriptors(strides, strides, 0, pages, pages, layers, False, False)
    descs = np.zeros((3, 6), dtype=np.int64)
    with pytest.raises(ValueError, match=r"position 1 \(0\) is out of order"):
        C.merge_descriptors(descs, np.array([1, 0, 1], dtype=np.int64), 2, 1)
    with pytest.raises(ValueError, match=r"position 2 \(5\) is out of order or range \[0, 2\)"):
        C.merge_descriptors(descs, np.array([0, 1, 5], dtype=np.int64), 2, 1)
    with pytest.raises(ValueError, match="2 positions for 3 descriptors"):
        C.merge_descriptors(descs, np.array([0, 1], dtype=np.int64), 2, 1)


def test_planning_does_not_hand_the_gil_to_a_busy_thread():
    """With numpy, every large operation let a spinning thread in for a switch interval; the C
    planning keeps the GIL. Counted, not timed: the spinner's loop count while the planning
    runs stays below what it does in one switch interval had it been let in every time."""
    dev, host, engine = pools("layer_first", 512)
    rng = np.random.default_rng(0)
    plan = engine.reload_plan(rng.permutation(512)[:256], rng.permutation(512)[:256])
    spins = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            spins[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    time.sleep(0.05)  # the spinner is running and holding the GIL whenever it may
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # no forced switch from here on: only a GIL release lets the spinner in
    try:
        before = spins[0]
        batch = native.layered(host, dev, plan, plan.layers)
        during = spins[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        t.join()
    assert batch.ends[-1] == len(batch.descs)
    # one hand-off lets the spinner run until it is asked for the GIL back: far more than 1000 loops
    assert during < 1000, f"the spinner ran {during} loops during the planning: the GIL was handed off"


def test_merge_refuses_a_layer_count_whose_table_cannot_be_allocated() -> None:
    """layers = 2**61 + 1 made the table's size wrap to 8 bytes, then wrote past it (segfault)."""
    from hicache.transfer import _native  # type: ignore[attr-defined]

    with pytest.raises(MemoryError):
        _native.merge_descriptors(np.zeros((0, 6), np.int64), None, 2**61 + 1, 0)
