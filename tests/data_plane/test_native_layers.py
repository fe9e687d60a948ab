"""The native path copies a whole transfer in one C call (copy_pieces), publishing the count
of layers done into a progress word that waiters wait on without the GIL."""

from __future__ import annotations

import threading

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
@pytest.mark.parametrize("page_size", [4, 64])  # one small transfer copied inline; one on 2 threads
def test_a_layerwise_reload_is_bit_exact_and_publishes_every_layer(layout: str, page_size: int) -> None:
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
        assert [int(w) for w in words.array] == [g.layer_num, g.layer_num]  # the copy's word and the spare
    for src, dst in ((4, 5), (1, 0), (2, 1)):
        assert torch.equal(dev.read_page(dst), before[src])


def test_a_failed_copy_fails_every_layer_wait_and_frees_the_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    g = mimo(64)
    dev, host = DeviceKVPool(g, 4), HostKVPool(g, 4)
    engine = TransferEngine(dev, host, "native", copy_threads=2)
    real = native.SmallCopy.__call__

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("copy broke")

    monkeypatch.setattr(native.SmallCopy, "__call__", broken)
    words = ProgressWords.private(2)  # as a sidecar's progress block gives them
    for progress in (None, words):  # 2.9 MB: copied before it returns, on 2 threads
        handle = engine.reload_async([0, 1], [2, 3], progress=progress)
        with pytest.raises(RuntimeError, match="copy broke"):
            handle.wait_layer(0, timeout=30)
        with pytest.raises(RuntimeError, match="copy broke"):
            handle.wait(30)
    assert words.done() == FAILED and [int(w) for w in words.array] == [FAILED, FAILED]
    monkeypatch.setattr(native.SmallCopy, "__call__", real)
    engine.reload_async([0, 1], [2, 3]).wait(30)  # the failed transfer no longer holds the pages
    engine.close()


def test_an_engine_never_asks_for_more_threads_than_one_c_call_runs() -> None:
    g = mimo(4)
    with TransferEngine(DeviceKVPool(g, 2), HostKVPool(g, 2), "native", copy_threads=500) as engine:
        assert engine.threads == 64


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


def test_an_inline_native_reload_says_every_layer_is_ready_and_no_layers_is_a_no_op() -> None:
    g = mimo(4)
    dev, host = DeviceKVPool(g, 4), HostKVPool(g, 4)
    fill_random(host, 2)
    with TransferEngine(dev, host, "native") as engine:
        handle = engine.reload_async([1], [2])  # small: copied before it returns, no progress words
        assert handle.wait(30) == g.page_bytes
        assert handle.done() and handle.layers_ready == g.layer_num  # was 0: nothing was published
        empty = engine.reload_async([1], [3], layers=[])
        assert empty.wait(30) == 0 and empty.done()  # was ValueError from C: a template of 0 layers
        assert engine.reload([1], [3], layers=[]) == 0


def test_progress_word_calls_refuse_values_that_do_not_fit_and_a_nan_timeout() -> None:
    words = ProgressWords.private(1)
    address = words.addresses[0]
    for bad in (-1, 2**32):  # before: wrapped silently (-1 became FAILED; 2**32 a target of 0)
        with pytest.raises(ValueError, match=f"a progress word holds 0..4294967295, got {bad}"):
            native.publish(address, bad)
        with pytest.raises(ValueError, match="a progress word holds"):
            native.wait_progress(address, bad, 1.0)
    assert int(words.array[0]) == 0
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds"):
        native.wait_progress(address, 1, float("nan"))
    publisher = threading.Timer(0.05, native.publish, (address, 3))
    publisher.start()
    assert native.wait_progress(address, 3, float("inf")) == 3  # inf: no limit (was an out-of-range cast)
    publisher.join()
