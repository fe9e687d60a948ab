"""Asynchronous native transfers run on the C copy queue (_native_queue.c): in order, on a
thread that never takes the GIL, their end known from their progress words alone."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from conftest import load_config
from helpers import fill_random, held_by_another_thread, in_forked_child

from hicache.geometry import KVGeometry
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.transfer import TransferEngine, native
from hicache.transfer.progress import ProgressWords

pytestmark = pytest.mark.skipif(not native.available(), reason="the C extension is not built")


def mimo() -> KVGeometry:
    return KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=64)  # 1.47 MB pages


class Keep:
    """A `keep` object that can be watched with a weak reference."""


def one_copy(dst: np.ndarray, src: np.ndarray, shift: int = 0) -> tuple[int, int, int, int, np.ndarray, np.ndarray]:
    """copy_pieces' buffer and descriptor arguments: all of src into dst (at `shift`), one layer."""
    descs = np.array([[shift, 0, 1, src.nbytes, src.nbytes, src.nbytes]], dtype=np.int64)
    return dst.ctypes.data, dst.nbytes, src.ctypes.data, src.nbytes, descs, np.array([1], np.int64)


def test_queued_copies_run_in_the_order_they_were_submitted() -> None:
    """b <- a, then c <- b: c holds a's bytes only if the second copy started after the first."""
    from hicache.transfer import _native  # type: ignore[attr-defined]

    n = 64 << 20  # long enough that a second copy started at once would read b half-written
    a = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    b, c = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    words = ProgressWords.private(2)
    queue = _native.CopyQueue()
    queue.submit(*one_copy(b, a), 1, True, 2, 1 << 20, words.addresses[0], (a, b))
    queue.submit(*one_copy(c, b), 1, True, 2, 1 << 20, words.addresses[1], (b, c))
    assert words.wait(1, timeout=60)
    assert np.array_equal(c, a)
    queue.close()
    assert queue.pending() == 0


def test_the_queue_checks_before_it_queues_and_refuses_work_once_closed() -> None:
    from hicache.transfer import _native  # type: ignore[attr-defined]

    dst, src = np.zeros(64, np.uint8), np.arange(64, dtype=np.uint8)
    words = ProgressWords.private(1)
    queue = _native.CopyQueue()
    with pytest.raises(ValueError, match="descriptor 0 writes past the destination's 64 bytes"):
        queue.submit(*one_copy(dst, src, shift=8), 1, False, 1, 0, words.addresses[0], None)  # 8 bytes past dst
    assert queue.pending() == 0 and not dst.any() and not words.array.any()  # nothing queued, nothing run
    queue.close()
    queue.close()  # idempotent
    with pytest.raises(RuntimeError, match="the copy queue is closed"):
        queue.submit(*one_copy(dst, src), 1, False, 1, 0, words.addresses[0], None)


def test_a_queued_copy_holds_keep_until_it_is_done_and_close_waits_for_it() -> None:
    from hicache.transfer import _native  # type: ignore[attr-defined]

    n = 32 << 20
    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    words = ProgressWords.private(1)
    keep = Keep()
    watch = weakref.ref(keep)
    queue = _native.CopyQueue()
    queue.submit(*one_copy(dst, src), 1, True, 2, 1 << 20, words.addresses[0], keep)
    del keep
    gc.collect()
    queue.close()  # returns once the copy is done
    assert words.done() == 1 and dst.all()
    assert watch() is None  # released after the copy


def test_two_closes_at_once_both_return_once_the_queued_copies_are_done() -> None:
    """The second close() joined the thread the first was joining (undefined: it hung)."""
    from hicache.transfer import _native  # type: ignore[attr-defined]

    n = 128 << 20
    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    words = ProgressWords.private(1)
    queue = _native.CopyQueue()
    for _ in range(4):  # long enough that the second close comes while the first one waits
        queue.submit(*one_copy(dst, src), 1, True, 1, 1 << 20, words.addresses[0], (src, dst))
    closers = [threading.Thread(target=queue.close, daemon=True) for _ in range(2)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(120)
    assert not any(closer.is_alive() for closer in closers)  # before: the second never returned
    assert queue.pending() == 0 and words.done() == 1 and dst.all()


def test_an_async_reload_starts_and_ends_while_this_thread_keeps_the_gil() -> None:
    """With a switch interval of an hour, no other Python thread runs while this one spins:
    the copy must start, run and publish without ever taking the GIL."""
    g = mimo()
    dev, host = DeviceKVPool(g, 8), HostKVPool(g, 8)
    fill_random(host, 1)
    with TransferEngine(dev, host, "native", copy_threads=2) as engine:
        old = sys.getswitchinterval()
        sys.setswitchinterval(3600.0)
        try:
            handle = engine.reload_async([0, 1, 2, 3], [7, 6, 5, 4])  # 5.9 MB: queued, not inline
            deadline = time.monotonic() + 60
            while not handle.done() and time.monotonic() < deadline:
                pass  # pure Python: holds the GIL throughout
            finished = handle.done()
        finally:
            sys.setswitchinterval(old)
        assert finished, "the queued copy did not finish while Python held the GIL"
        handle.wait(30)
    for h, d in ((0, 7), (1, 6), (2, 5), (3, 4)):
        assert torch.equal(dev.read_page(d), host.read_page(h))


def test_an_async_offload_then_a_reload_of_the_same_host_pages_sees_the_offloaded_bytes() -> None:
    """Asynchronous transfers keep their order: the reload reads the host pages after the
    offload queued before it has written them."""
    g = mimo()
    dev, host = DeviceKVPool(g, 12), HostKVPool(g, 8)
    fill_random(dev, 2)
    before = [dev.read_page(p).clone() for p in range(4)]
    with TransferEngine(dev, host, "native", copy_threads=2) as engine:
        offload = engine.offload_async([0, 1, 2, 3], [4, 5, 6, 7])
        reload = engine.reload_async([4, 5, 6, 7], [8, 9, 10, 11])
        reload.wait(60)
        assert offload.done()
    for p in range(4):
        assert torch.equal(dev.read_page(8 + p), before[p])


def test_closing_the_engine_waits_for_queued_transfers_and_a_later_one_still_runs() -> None:
    g = mimo()
    dev, host = DeviceKVPool(g, 8), HostKVPool(g, 8)
    fill_random(dev, 3)
    engine = TransferEngine(dev, host, "native", copy_threads=2)
    handles = [engine.offload_async([i], [i]) for i in range(4)] + [engine.offload_async([4, 5, 6], [4, 5, 6])]
    engine.close()
    assert all(h.done() for h in handles)
    engine.offload_async([7, 0, 1], [7, 0, 1]).wait(30)  # a new queue after close, as the thread pools
    engine.close()
    for p in range(8):
        assert torch.equal(host.read_page(p), dev.read_page(p))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_asynchronous_transfers_on_threads_of_its_own() -> None:
    """The parent's copy queue thread (and thread pools) are not copied by fork: the child's
    engine must start its own instead of refusing (or waiting on a thread that is not there)."""
    g = mimo()
    dev, host = DeviceKVPool(g, 8), HostKVPool(g, 8)
    fill_random(dev, 5)
    with TransferEngine(dev, host, "native", copy_threads=2) as engine:
        engine.offload_async([0, 1, 2, 3], [0, 1, 2, 3]).wait(30)  # the parent's queue thread runs

        def child() -> bool:
            engine.offload_async([4, 5, 6, 7], [4, 5, 6, 7]).wait(30)  # 5.9 MB: queued
            engine.close()
            return all(raw_page(host, p) == raw_page(dev, p) for p in range(8))  # no torch op: a
            # child's torch waits forever for the OpenMP threads the parent's copy_ started

        assert in_forked_child(child)


def test_a_forked_child_is_not_held_by_the_parents_unfinished_transfers() -> None:
    """At the fork a parent thread holds the engine's page registry, and a transfer to host
    pages 0..3 is unfinished. Neither is copied as a thread into the child: its transfers to
    those pages must run, not hang on the lock or be refused for a transfer that never ends."""
    g = mimo()
    dev, host = DeviceKVPool(g, 8), HostKVPool(g, 8)
    fill_random(dev, 6)
    with TransferEngine(dev, host, "native", copy_threads=2) as engine:
        registry = engine._writers
        with registry.reserve("host_pages", np.arange(4)) as register:
            register(lambda: False)  # never done in the parent either, while this test runs
        with pytest.raises(ValueError, match="unfinished"):
            engine.offload([0], [0])

        def child() -> bool:
            engine.offload([0, 1, 2, 3], [0, 1, 2, 3])
            return all(raw_page(host, p) == raw_page(dev, p) for p in range(4))

        with held_by_another_thread(registry._lock):
            assert in_forked_child(child)


def raw_page(pool: DeviceKVPool | HostKVPool, page: int) -> bytes:
    pieces = pool.page_pieces(page)
    assert pieces is not None
    return b"".join(bytes(p) for p in pieces)
