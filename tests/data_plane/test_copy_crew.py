"""A transfer's shares run on the copy crew (_native_crew.c): threads that stay between
calls. Every share is copied exactly once, whoever takes it: the caller alone, the crew,
threads of the call's own when another call holds the crew, or a forked child's new crew."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from helpers import in_forked_child

from hicache.transfer import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the C extension is not built")


def shared_copy(dst: np.ndarray, src: np.ndarray, shares: int, words: np.ndarray | None = None) -> None:
    """Copy src into dst in `shares` shares of two layers each (descriptors of 4 KB rows), each
    share publishing its layers into its word of `words` when given."""
    from hicache.transfer import _native  # type: ignore[attr-defined]

    rows = src.nbytes // 4096
    descs = np.array([[r * 4096, r * 4096, 1, 4096, 4096, 4096] for r in range(rows)], dtype=np.int64)
    parts = np.array_split(descs, shares)
    share_args = [(p, np.array([len(p) // 2, len(p)], dtype=np.int64)) for p in parts]
    addrs = [0] * shares if words is None else [words.ctypes.data + 4 * i for i in range(shares)]
    _native.copy_shares(dst.ctypes.data, dst.nbytes, src.ctypes.data, src.nbytes, share_args, 1, False, addrs)


@pytest.mark.parametrize("shares", [2, 3, 64])
def test_every_share_is_copied_once_and_publishes_its_layers(shares: int) -> None:
    rng = np.random.default_rng(shares)
    for _ in range(50):  # the same crew, call after call
        src = rng.integers(0, 255, 4096 * 256, dtype=np.uint8)
        dst = np.zeros_like(src)
        words = np.zeros(shares, dtype=np.uint32)
        shared_copy(dst, src, shares, words)
        assert np.array_equal(dst, src)
        assert words.tolist() == [2] * shares


def test_calls_from_several_threads_at_once_each_copy_their_own_bytes() -> None:
    """One call holds the crew; the others start threads of their own. None waits forever,
    and no share of one call lands in another's buffers."""
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for i in range(100):
            src = rng.integers(0, 255, 4096 * 64, dtype=np.uint8)
            dst = np.zeros_like(src)
            shared_copy(dst, src, 2 + i % 3)
            if not np.array_equal(dst, src):
                errors.append(f"thread {seed} call {i}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a call never returned"
    assert errors == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_copies_with_a_crew_of_its_own() -> None:
    src = np.arange(4096 * 64, dtype=np.uint32).view(np.uint8)[: 4096 * 64]
    shared_copy(np.zeros_like(src), src, 2)  # the parent's crew is hired

    def child() -> bool:  # its crew's members were not copied by fork
        dst = np.zeros_like(src)
        for _ in range(20):
            shared_copy(dst, src, 4)
        return bool(np.array_equal(dst, src))

    assert in_forked_child(child)
