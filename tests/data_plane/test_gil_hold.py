"""Small copies keep the GIL; done handles answer without waiting.

A copy that lets go of the GIL must take it back, and beside a busy Python thread that can
cost a switch interval (5 ms). The C copy counts the copies that let go of it
(_native.gil_releases()), so these tests see which ones did, without timing anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import load_config
from helpers import fill_random, same_page

from hicache import DeviceKVPool, HostKVPool, KVGeometry, TransferEngine
from hicache.api import KeyStatus, TransferResult
from hicache.client.handles import ProgressSlot, ReloadHandle
from hicache.transfer import native
from hicache.transfer.handles import CpuTransferHandle
from hicache.transfer.progress import ProgressWords

needs_native = pytest.mark.skipif(not native.available(), reason="C extension not built")


def c() -> Any:
    assert native._native is not None
    return native._native


def released() -> int:
    return int(c().gil_releases())


def copy_bytes(nbytes: int, *, threads: int = 1, piece_bytes: int = native.PIECE_BYTES) -> tuple[int, bool]:
    """Copy nbytes (rows of 1000 bytes and a shorter last one, strided on the source) with
    copy_pieces; (GIL releases it made, whether the destination got exactly the source's bytes)."""
    row = 1000
    rows, tail = divmod(nbytes, row)
    src = torch.randint(0, 256, (2 * nbytes + 4096,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 4096, dtype=torch.uint8)
    descs = [[0, 0, rows, row, row, 2 * row]] if rows else []
    if tail:
        descs.append([rows * row, 2 * rows * row, 1, tail, tail, tail])
    d = np.array(descs, dtype=np.int64).reshape(-1, 6)
    ends = np.array([len(d)], dtype=np.int64)
    before = released()
    c().copy_pieces(
        dst.data_ptr(), dst.numel(), src.data_ptr(), src.numel(), d, ends, 1, False, threads, piece_bytes, 0
    )
    want = src[: 2 * rows * row].view(rows, 2 * row)[:, :row].reshape(-1) if rows else src[:0]
    if tail:
        want = torch.cat([want, src[2 * rows * row : 2 * rows * row + tail]])
    ok = torch.equal(dst[:nbytes], want) and not dst[nbytes:].any()
    return released() - before, ok


@needs_native
def test_the_bound_is_the_documented_one():
    assert c().hold_gil_bytes() == native.HOLD_GIL_BYTES == c().HOLD_GIL_BYTES == 4 << 20
    assert native.SHARE_MIN_BYTES >= native.HOLD_GIL_BYTES  # below it, one thread: the GIL is kept


@needs_native
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_a_copy_keeps_the_gil_up_to_the_bound_and_is_correct_around_it(delta):
    """At the default bound (4 MB): one byte below and exactly at it, the copy keeps the GIL;
    one byte above, it lets go of it. Each copies exactly the source's bytes."""
    count, ok = copy_bytes(native.HOLD_GIL_BYTES + delta)
    assert ok
    assert count == (1 if delta > 0 else 0)


@needs_native
@pytest.mark.parametrize("bound", [0, 1, 4096, 10_000])
def test_the_bound_can_be_moved_and_is_set_back(bound):
    before = c().hold_gil_bytes(bound)
    try:
        assert before == native.HOLD_GIL_BYTES
        assert c().hold_gil_bytes() == bound
        for nbytes in {max(1, bound - 1), max(1, bound), bound + 1}:
            count, ok = copy_bytes(nbytes)
            assert ok, nbytes
            assert count == (1 if nbytes > bound else 0), (nbytes, bound)
    finally:
        c().hold_gil_bytes(before)
    assert c().hold_gil_bytes() == native.HOLD_GIL_BYTES


@needs_native
def test_a_bad_bound_is_refused_naming_it():
    with pytest.raises(ValueError, match="-5"):
        c().hold_gil_bytes(-5)
    assert c().hold_gil_bytes() == native.HOLD_GIL_BYTES


@needs_native
def test_a_small_copy_the_crew_shares_lets_go_of_the_gil():
    """Several pieces on several threads: the caller would hold the GIL while it waits for
    the crew, so it lets go of it however small the copy; one piece has no helper and keeps it."""
    count, ok = copy_bytes(64 << 10, threads=2, piece_bytes=8 << 10)
    assert ok and count == 1
    count, ok = copy_bytes(64 << 10, threads=2, piece_bytes=1 << 20)  # one piece: this thread alone
    assert ok and count == 0


def engine(page_size: int = 16) -> TransferEngine:
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=page_size)
    dev = DeviceKVPool(g, 32, "cpu")
    host = HostKVPool(g, 32)
    fill_random(dev, seed=1)
    fill_random(host, seed=2)
    return TransferEngine(dev, host, "native")


@needs_native
def test_engine_transfers_below_the_bound_keep_the_gil_and_larger_ones_let_go():
    eng = engine()
    page = eng.geometry.page_bytes
    small = max(1, (native.HOLD_GIL_BYTES // page) - 1)
    large = native.HOLD_GIL_BYTES // page + 2
    assert small * page <= native.HOLD_GIL_BYTES < large * page <= 32 * page
    with eng:
        before = released()
        eng.offload(list(range(small)), list(range(small)))
        eng.reload(list(range(small)), list(range(10, 10 + small)))
        eng.reload_async([0], [20]).wait()  # a layer-wise one, copied in the caller
        assert released() == before
        for p in range(small):
            assert same_page(eng.device_pool, p, eng.host_pool, p)
            assert same_page(eng.host_pool, p, eng.device_pool, 10 + p)
        eng.offload(list(range(large)), list(range(large)))
        assert released() > before
        for p in range(large):
            assert same_page(eng.device_pool, p, eng.host_pool, p)


class NoWait:
    """A handle's condition that fails the test on any wait (entering it, an uncontended
    lock, is allowed: it does not let go of the GIL)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def wait(self, *args: object, **kwargs: object) -> bool:
        raise AssertionError("a done handle waited")

    wait_for = wait

    def notify_all(self) -> None:
        return None


def no_native_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> int:
        raise AssertionError("a done handle waited on a progress word (without the GIL)")

    monkeypatch.setattr(native, "wait_progress", refuse)


@needs_native
def test_a_done_engine_handle_answers_without_waiting(monkeypatch):
    """A small layer-wise reload is copied before reload_async returns; its handle's
    wait_layer, done and wait answer without a wait or a GIL release, as does a queued
    (large) one's once its words say every layer is done."""
    eng = engine()
    with eng:
        small = eng.reload_async([1], [2])
        large_pages = native.LAYERED_INLINE_BYTES // eng.geometry.page_bytes + 2
        large = eng.reload_async(list(range(large_pages)), list(range(10, 10 + large_pages)))
        assert isinstance(large, CpuTransferHandle) and large.words is not None
        while large.layers_ready < len(large.layers):  # without wait(): finish() may not have run yet
            native.wait_progress(large.words.addresses[0], len(large.layers), 1.0)
        no_native_wait(monkeypatch)
        before = released()
        for handle in (small, large):
            assert isinstance(handle, CpuTransferHandle)
            handle._cond = NoWait()  # type: ignore[assignment]
            for layer in handle.layers:
                handle.wait_layer(layer)
            assert handle.done()
            assert handle.wait() == handle.nbytes
        assert released() == before
        assert same_page(eng.host_pool, 1, eng.device_pool, 2)


def test_a_reload_answered_done_waits_for_nothing(monkeypatch):
    """The sidecar copied it before answering (done): every wait answers at once."""
    no_native_wait(monkeypatch)

    def watch() -> Any:
        raise AssertionError("a done reload followed Watch")

    handle = ReloadHandle(TransferResult((KeyStatus.LOADED,), 100, "op-1", True), 9, watch)
    handle._cond = NoWait()  # type: ignore[assignment]
    for layer in range(9):
        handle.wait_layer(layer)
    assert handle.done()
    handle.wait()


@needs_native
def test_a_reload_whose_slot_says_done_waits_for_nothing(monkeypatch):
    """A layer-wise reload whose progress slot already counts every layer: the waits read the
    words and return, without a futex wait (which lets go of the GIL) or Watch."""
    row = np.zeros(16, dtype=np.uint32)
    row[0], row[1] = 7, 9  # generation 7, nine layers done
    started = []

    def watch() -> Any:
        started.append(1)
        return iter(())

    handle = ReloadHandle(TransferResult((KeyStatus.LOADED,), 100, "op-2", False), 9, watch, ProgressSlot(row, 7, 1))
    no_native_wait(monkeypatch)
    for layer in range(9):
        handle.wait_layer(layer)
    handle.wait()
    assert handle.done() and not started
    handle._cond = NoWait()  # type: ignore[assignment]
    assert handle.done()  # seen done: no lock either


def test_progress_words_at_their_target_do_not_wait(monkeypatch):
    words = ProgressWords.private(2)
    words.array[:] = 5
    no_native_wait(monkeypatch)
    assert words.wait(5, None) and words.wait(3, 0.0)
