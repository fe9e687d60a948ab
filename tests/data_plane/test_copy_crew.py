"""A transfer's pieces run on the copy crew (_native_crew.c): threads that stay between
calls, taking pieces one at a time in order. Every piece is copied, whoever takes it: the
caller alone, the crew, threads of the call's own when another call holds the crew, or a
forked child's new crew; and the progress word never says a layer is done before it is."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from helpers import in_forked_child

from hicache.transfer import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the C extension is not built")
ROW = 4096


def row_descs(rows: int) -> np.ndarray:
    """One descriptor per 4 KB row, row r of src to row r of dst."""
    starts = np.arange(rows, dtype=np.int64) * ROW
    return np.stack([starts, starts, *(np.full(rows, v, np.int64) for v in (1, ROW, ROW, ROW))], axis=1)


def copy(
    dst: np.ndarray, src: np.ndarray, threads: int, layers: int = 2, word: np.ndarray | None = None, piece: int = 8192
) -> None:
    """Copy src into dst in `layers` layers of equal rows, on up to `threads` threads, in pieces
    of about `piece` bytes, the count of layers done going into `word` when given."""
    from hicache.transfer import _native  # type: ignore[attr-defined]

    rows = src.nbytes // ROW
    ends = np.linspace(0, rows, layers + 1).astype(np.int64)[1:]
    addr = 0 if word is None else word.ctypes.data
    _native.copy_pieces(
        dst.ctypes.data, dst.nbytes, src.ctypes.data, src.nbytes, row_descs(rows), ends, 1, False, threads, piece, addr
    )


@pytest.mark.parametrize("threads", [1, 2, 3, 64])
def test_every_piece_is_copied_and_every_layer_published(threads: int) -> None:
    rng = np.random.default_rng(threads)
    for i in range(50):  # the same crew, call after call
        src = rng.integers(0, 255, ROW * 256, dtype=np.uint8)
        dst = np.zeros_like(src)
        word = np.zeros(1, dtype=np.uint32)
        layers = 1 + i % 9
        copy(dst, src, threads, layers, word, piece=ROW * (1 + i % 5))
        assert np.array_equal(dst, src)
        assert int(word[0]) == layers


def test_the_word_never_counts_a_layer_whose_bytes_are_not_all_in_place() -> None:
    """Layer 0 is one 32 MB piece, the 16 after it 4 KB each: while one thread copies layer 0,
    the others finish the small layers, yet the word must stay at 0 until layer 0 is in. A
    Python thread reads the word while the copy runs without the GIL and checks each layer it
    counts."""
    from hicache.transfer import _native  # type: ignore[attr-defined]

    big, small = 32 << 20, 16
    src = np.random.default_rng(1).integers(1, 255, big + small * ROW, dtype=np.uint8)
    descs = np.concatenate([np.array([[0, 0, 1, big, big, big]], np.int64), row_descs(small)])
    descs[1:, :2] += big
    ends = np.arange(1, small + 2, dtype=np.int64)
    spans = [slice(0, big)] + [slice(big + i * ROW, big + (i + 1) * ROW) for i in range(small)]
    for _ in range(5):
        dst = np.zeros_like(src)
        word = np.zeros(1, dtype=np.uint32)
        args = (
            dst.ctypes.data,
            dst.nbytes,
            src.ctypes.data,
            src.nbytes,
            descs,
            ends,
            1,
            False,
            3,
            ROW,
            word.ctypes.data,
        )
        copier = threading.Thread(target=_native.copy_pieces, args=args)
        copier.start()
        seen: list[int] = []
        wrong: list[int] = []
        while True:
            finished = not copier.is_alive()  # then the word read next is the last one
            done = int(word[0])
            if not seen or done != seen[-1]:
                seen.append(done)
            wrong += [layer for layer in range(done) if not np.array_equal(dst[spans[layer]], src[spans[layer]])]
            if wrong or finished:
                break
        copier.join(60)
        assert wrong == [] and seen[-1] == small + 1 and seen == sorted(seen), (wrong, seen)


def test_layers_with_no_descriptors_count_as_done_in_order() -> None:
    from hicache.transfer import _native  # type: ignore[attr-defined]

    src = np.arange(ROW * 8, dtype=np.uint8)
    dst = np.zeros_like(src)
    word = np.zeros(1, dtype=np.uint32)
    ends = np.array([0, 4, 4, 8, 8], dtype=np.int64)  # layers 0, 2 and 4 are empty
    bufs = (dst.ctypes.data, dst.nbytes, src.ctypes.data, src.nbytes)
    _native.copy_pieces(*bufs, row_descs(8), ends, 1, False, 2, ROW, word.ctypes.data)
    assert np.array_equal(dst, src) and int(word[0]) == 5
    word[:] = 0
    _native.copy_pieces(*bufs, row_descs(0), np.zeros(3, np.int64), 1, False, 2, ROW, word.ctypes.data)
    assert int(word[0]) == 3  # nothing to copy: every layer is done


def test_copy_pieces_checks_its_arguments_before_copying() -> None:
    from hicache.transfer import _native  # type: ignore[attr-defined]

    src = np.arange(ROW * 4, dtype=np.uint8)
    dst = np.zeros_like(src)
    word = np.zeros(2, dtype=np.uint32)
    bufs = (dst.ctypes.data, dst.nbytes, src.ctypes.data, src.nbytes)
    ends = np.array([2, 4], np.int64)
    with pytest.raises(ValueError, match="layer_ends must rise to the descriptor count 4; entry 1 is 3"):
        _native.copy_pieces(*bufs, row_descs(4), np.array([2, 3], np.int64), 1, False, 2, ROW, word.ctypes.data)
    with pytest.raises(ValueError, match="threads must be 1 to 64, got 0"):
        _native.copy_pieces(*bufs, row_descs(4), ends, 1, False, 0, ROW, word.ctypes.data)
    with pytest.raises(ValueError, match="threads must be 1 to 64, got 65"):
        _native.copy_pieces(*bufs, row_descs(4), ends, 1, False, 65, ROW, word.ctypes.data)
    with pytest.raises(ValueError, match="progress word must be 4-byte aligned"):
        _native.copy_pieces(*bufs, row_descs(4), ends, 1, False, 2, ROW, word.ctypes.data + 1)
    bad = row_descs(4)
    bad[3, 0] = ROW * 4 - 1  # the last descriptor writes past the end: nothing runs
    with pytest.raises(ValueError, match="descriptor 3 writes past"):
        _native.copy_pieces(*bufs, bad, ends, 1, False, 2, ROW, word.ctypes.data)
    assert not dst.any() and not word.any()  # nothing copied, nothing published


def test_calls_from_several_threads_at_once_each_copy_their_own_bytes() -> None:
    """One call holds the crew; the others start threads of their own. None waits forever,
    and no piece of one call lands in another's buffers."""
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for i in range(100):
            src = rng.integers(0, 255, ROW * 64, dtype=np.uint8)
            dst = np.zeros_like(src)
            word = np.zeros(1, dtype=np.uint32)
            copy(dst, src, 2 + i % 3, 1 + i % 4, word)
            if not np.array_equal(dst, src) or int(word[0]) != 1 + i % 4:
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
    src = np.arange(ROW * 64, dtype=np.uint32).view(np.uint8)[: ROW * 64]
    copy(np.zeros_like(src), src, 2)  # the parent's crew is hired

    def child() -> bool:  # its crew's members were not copied by fork
        dst = np.zeros_like(src)
        for _ in range(20):
            copy(dst, src, 4)
        return bool(np.array_equal(dst, src))

    assert in_forked_child(child)
