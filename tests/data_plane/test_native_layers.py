"""The native path copies a whole transfer in one C call per share (copy_layers), publishing
each layer into a progress word that waiters wait on without the GIL."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import load_config
from helpers import fill_random

from hicache.geometry import KVGeometry
from hicache.pools import LAYOUTS, DeviceKVPool, HostKVPool
from hicache.transfer import TransferEngine, native
from hicache.transfer.progress import FAILED, ProgressWords

pytestmark = pytest.mark.skipif(not native.available(), reason="the C extension is not built")


def mimo(page_size: int) -> KVGeometry:
    return KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=page_size)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [4, 64])  # one small transfer copied inline; one of 2 shares
def test_a_layerwise_reload_is_one_call_per_share_and_bit_exact(layout: str, page_size: int) -> None:
    g = mimo(page_size)
    dev, host = DeviceKVPool(g, 6), HostKVPool(g, 5, layout)
    fill_random(dev, 3)
    before = {p: dev.read_page(p).clone() for p in (4, 1, 2)}
    with TransferEngine(dev, host, "native", copy_threads=2) as engine:
        engine.offload([4, 1, 2], [0, 3, 2])
        words = ProgressWords.private(2)
        handle = engine.reload_async([0, 3, 2], [5, 0, 1], progress=words)
        for layer in range(g.layer_num):
            handle.wait_layer(layer, timeout=30)
        handle.wait(30)
        assert [int(w) for w in words.array] == [g.layer_num, g.layer_num]  # every share published every layer
    for src, dst in ((4, 5), (1, 0), (2, 1)):
        assert torch.equal(dev.read_page(dst), before[src])


def test_a_failed_share_fails_every_layer_wait_and_frees_the_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    g = mimo(64)
    dev, host = DeviceKVPool(g, 4), HostKVPool(g, 4)
    engine = TransferEngine(dev, host, "native", copy_threads=2)
    real = native.layered_call

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        def fail() -> None:
            raise RuntimeError("share broke")

        return fail

    monkeypatch.setattr(native, "layered_call", broken)
    handle = engine.reload_async([0, 1], [2, 3])
    with pytest.raises(RuntimeError, match="share broke"):
        handle.wait_layer(0, timeout=30)
    with pytest.raises(RuntimeError, match="share broke"):
        handle.wait(30)
    assert handle.words is not None and handle.words.done() == FAILED  # type: ignore[attr-defined]
    monkeypatch.setattr(native, "layered_call", real)
    engine.reload_async([0, 1], [2, 3]).wait(30)  # the failed transfer no longer holds the pages
    engine.close()


def test_an_engine_never_asks_for_more_shares_than_one_c_call_runs() -> None:
    g = mimo(4)
    with TransferEngine(DeviceKVPool(g, 2), HostKVPool(g, 2), "native", copy_threads=500) as engine:
        assert engine.shares == 64


def test_copy_shares_checks_its_arguments_before_copying() -> None:
    from hicache.transfer import _native  # type: ignore[attr-defined]

    dst, src = np.zeros(64, np.uint8), np.arange(64, dtype=np.uint8)
    descs = np.array([[0, 0, 1, 16, 16, 16], [16, 16, 1, 16, 16, 16]], dtype=np.int64)
    words = np.zeros(4, np.uint32)
    ok_ends = np.array([1, 2], np.int64)
    bufs = (dst.ctypes.data, 64, src.ctypes.data, 64)
    with pytest.raises(ValueError, match="layer_ends must rise to the descriptor count 2; entry 1 is 1"):
        _native.copy_shares(*bufs, [(descs, np.array([1, 1], np.int64))], 1, False, [words.ctypes.data])
    with pytest.raises(ValueError, match="progress word 0 must be 4-byte aligned"):
        _native.copy_shares(*bufs, [(descs, ok_ends)], 1, False, [words.ctypes.data + 1])
    with pytest.raises(ValueError, match="one progress address each"):
        _native.copy_shares(*bufs, [(descs, ok_ends)], 1, False, [])
    bad = descs.copy()
    bad[1, 0] = 60
    good = descs[:1].copy()
    with pytest.raises(ValueError, match="descriptor 1 writes past"):  # the second share is bad: nothing runs
        _native.copy_shares(
            *bufs,
            [(good, np.array([1], np.int64)), (bad, ok_ends)],
            1,
            False,
            [words.ctypes.data, words.ctypes.data + 4],
        )
    assert not dst.any() and not words.any()  # nothing copied, nothing published
    second = np.array([[32, 32, 1, 32, 32, 32]], dtype=np.int64)
    shares = [(descs, ok_ends), (second, np.array([0, 1], np.int64))]
    _native.copy_shares(*bufs, shares, 1, False, [words.ctypes.data, words.ctypes.data + 4])
    assert words[:2].tolist() == [2, 2] and np.array_equal(dst, src)  # two shares on two threads, both layers


def test_a_waiter_waits_without_the_gil_and_sees_the_published_value() -> None:
    words = ProgressWords.private(1)
    seen: list[int] = []
    waiter = threading.Thread(target=lambda: seen.append(native.wait_progress(words.addresses[0], 3, 30.0)))
    waiter.start()
    count = 0
    while count < 200_000:  # Python work in this thread while the other one waits: it needs the GIL
        count += 1
    words.publish(0, 3)
    waiter.join(30)
    assert seen == [3], "the waiter held the GIL (or missed the wake-up) and timed out"
    assert native.wait_progress(words.addresses[0], 9, 0.01) == 3  # a timeout answers what it read


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_small_layered_batch_holds_each_layers_chunks_in_that_layers_slice(layout: str) -> None:
    g = mimo(4)
    dev, host = DeviceKVPool(g, 6), HostKVPool(g, 5, layout)
    plan = TransferEngine(dev, host, "torch").reload_plan([0, 3, 2], [5, 0, 1])
    batch = native.layered(host, dev, plan, plan.layers)
    assert batch.nbytes < native.LAYERED_INLINE_BYTES
    count = len(plan.layers)
    parts = native.chunk_parts(host, dev, plan, np.asarray(plan.layers, dtype=np.int64))
    start = 0
    for i, end in enumerate(int(e) for e in batch.ends):
        want = sorted(tuple(row) for part in parts for j, row in enumerate(part.tolist()) if j % count == i)
        assert sorted(map(tuple, batch.descs[start:end].tolist())) == want, i
        start = end
    assert start == len(batch.descs)


def test_pages_are_free_for_another_transfer_once_every_layer_is_published() -> None:
    """A process that waited on the progress words (every layer in place) reloads into the
    same pages at once: it must not be refused. A queued copy never calls finish(); its
    words are all the engine's single-writer check has to go on."""
    g = mimo(64)
    dev, host = DeviceKVPool(g, 8), HostKVPool(g, 8)
    engine = TransferEngine(dev, host, "native", copy_threads=2)
    engine.offload([0, 1, 2, 3], [0, 1, 2, 3])
    first = engine.reload_async([0, 1, 2, 3], [4, 5, 6, 7])  # 5.9 MB: on the C copy queue
    for layer in range(g.layer_num):
        first.wait_layer(layer, timeout=30)
    assert first.done()  # every layer published: its pages are written
    engine.reload([0, 1, 2, 3], [4, 5, 6, 7])  # refused before: "destination of an unfinished transfer"
    first.wait(30)
    engine.close()
