"""hicache.storage._xxh3: the stored page's XXH3-64 over its pieces, without the GIL. It must
give python-xxhash's value for every input over 240 bytes, however the input is cut, on both
of its loops (AVX2 and the portable one)."""

from __future__ import annotations

import errno
import os
import random
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from tier_helpers import GEOMETRIES, identity, key, payload

from hicache.storage import page_format as fmt

try:
    from hicache.storage import _xxh3
except ImportError:
    _xxh3 = None  # type: ignore[assignment]

needs_ext = pytest.mark.skipif(_xxh3 is None, reason="hicache.storage._xxh3 is not built")


def test_extension_is_built() -> None:
    """Where a C compiler exists the install must have built it (else reads verify holding the GIL)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: python-xxhash is the documented fallback")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers: python-xxhash is the documented fallback")
    assert _xxh3 is not None, "hicache.storage._xxh3 is not built: pip install -e . (or make setup) builds it"


LOOPS = ["portable", "avx2", "avx512"]


@pytest.fixture(params=LOOPS)
def loop(request: pytest.FixtureRequest) -> Iterator[str]:
    if _xxh3 is None:
        pytest.skip("hicache.storage._xxh3 is not built")
    if request.param not in _xxh3.loops():
        pytest.skip(f"this CPU cannot run the {request.param} loop")
    before = _xxh3.set_loop(request.param)
    yield request.param
    _xxh3.set_loop(before)


def cut(data: bytes, rng: random.Random, pieces: int) -> list[bytes]:
    points = sorted(rng.choices(range(len(data) + 1), k=pieces - 1))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


# around the edges of a stripe (64 bytes), a block (16 stripes) and the 240-byte limit
LENGTHS = [241, 242, 255, 256, 257, 319, 320, 321, 1023, 1024, 1025, 1088, 2047, 2048, 2049, 16385, 1 << 20]


@pytest.mark.parametrize("length", LENGTHS)
def test_equals_python_xxhash_whole_and_cut(loop: str, length: int) -> None:
    rng = random.Random(length)
    data = rng.randbytes(length)
    want = xxhash.xxh3_64_intdigest(data)
    assert _xxh3.xxh3_64_long([data]) == want
    for pieces in (2, 3, 7, 64):
        assert _xxh3.xxh3_64_long(cut(data, rng, pieces)) == want, pieces


@needs_ext
@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=241, max_size=5000), cuts=st.lists(st.integers(0, 5000), max_size=8))
def test_any_cut_of_any_long_input(data: bytes, cuts: list[int]) -> None:
    points = sorted(c % (len(data) + 1) for c in cuts)
    parts = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    want = xxhash.xxh3_64_intdigest(data)
    for name in _xxh3.loops():
        before = _xxh3.set_loop(name)
        try:
            assert _xxh3.xxh3_64_long(parts) == want, name
        finally:
            _xxh3.set_loop(before)


def test_buffers_of_any_kind_count_by_bytes(loop: str) -> None:
    data = np.random.default_rng(3).integers(0, 255, 5000, dtype=np.uint8)
    raw = data.tobytes()
    parts = [memoryview(raw)[:100], bytearray(raw[100:2000]), data[2000:].view(np.uint32)]
    assert _xxh3.xxh3_64_long(parts) == xxhash.xxh3_64_intdigest(raw)


@needs_ext
@pytest.mark.parametrize("length", [0, 1, 16, 17, 128, 129, 240])
def test_short_inputs_are_left_to_python_xxhash(length: int) -> None:
    data = random.Random(length).randbytes(length)
    assert _xxh3.xxh3_64_long([data]) is None
    assert _xxh3.xxh3_64_long([data[:3], data[3:]]) is None


@needs_ext
def test_bad_arguments_name_what_is_wrong() -> None:
    with pytest.raises(TypeError, match="sequence of buffers"):
        _xxh3.xxh3_64_long(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="str"):
        _xxh3.xxh3_64_long([b"x" * 300, "not bytes"])  # type: ignore[list-item]
    strided = np.zeros((100, 8), np.uint8)[:, :4]
    with pytest.raises(ValueError, match="not C-contiguous"):
        _xxh3.xxh3_64_long([strided])


def test_pages_written_with_either_checksum_path_verify_with_the_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page format's XXH3 is the same value with and without the extension, so a page
    written by a process without it reads back in one with it, and the reverse."""
    g = GEOMETRIES["mimo_kv"]
    ident = identity(g)
    data = payload(g, 1)
    with_ext = fmt.encode_page(ident, key(1), data)
    monkeypatch.setattr(fmt, "_xxh3_long", None)
    without = fmt.encode_page(ident, key(1), data)
    assert with_ext == without and with_ext[6] == fmt.XXH3_64
    assert bytes(fmt.decode_page(ident, key(1), with_ext)) == data
    monkeypatch.undo()
    assert bytes(fmt.decode_page(ident, key(1), without)) == data
    damaged = bytearray(without)
    damaged[-1] ^= 1
    with pytest.raises(fmt.PageError, match="checksum"):
        fmt.decode_page(ident, key(1), damaged)


def written(tmp_path: Path, data: bytes) -> int:
    path = tmp_path / "page"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


@pytest.mark.parametrize(
    ("key_bytes", "sizes"),
    [(32, [600_000]), (32, [81_920] * 18), (32, [7] * 200 + [3000]), (32, [0, 5000, 0, 300_000, 0]), (400, [30])],
    ids=["one-piece-of-3-windows", "18-pieces", "200-tiny-pieces", "empty-pieces", "prefix-holds-the-tail"],
)
def test_pread_xxh3_reads_the_pieces_and_hashes_prefix_and_pieces(
    loop: str, tmp_path: Path, key_bytes: int, sizes: list[int]
) -> None:
    rng = random.Random(sum(sizes))
    prefix = [rng.randbytes(40), rng.randbytes(key_bytes)]
    body = rng.randbytes(sum(sizes))
    fd = written(tmp_path, b"skip" * 3 + body + b"after")
    try:
        pieces = [bytearray(n) for n in sizes]
        got, digest = _xxh3.pread_xxh3(fd, 12, prefix, [memoryview(p) for p in pieces])
        assert got == len(body) and b"".join(pieces) == body
        assert digest == xxhash.xxh3_64_intdigest(b"".join(prefix) + body)
    finally:
        os.close(fd)


@needs_ext
def test_pread_xxh3_short_file_short_input_and_bad_arguments(tmp_path: Path) -> None:
    fd = written(tmp_path, bytes(range(256)) * 40)  # 10240 bytes
    try:
        short = bytearray(20000)
        assert _xxh3.pread_xxh3(fd, 0, [b"h" * 48], [short]) == (10240, None)  # the file ended: no hash
        assert short[:10240] == bytes(range(256)) * 40
        tiny = bytearray(100)
        assert _xxh3.pread_xxh3(fd, 0, [b"x" * 40], [tiny]) == (100, None)  # 140 bytes: python-xxhash's
        with pytest.raises(ValueError, match="offset must be >= 0, got -1"):
            _xxh3.pread_xxh3(fd, -1, [], [tiny])
        with pytest.raises(BufferError, match="not writable"):
            _xxh3.pread_xxh3(fd, 0, [], [b"read-only" * 40])
        with pytest.raises(TypeError, match="prefix must be a sequence"):
            _xxh3.pread_xxh3(fd, 0, 7, [tiny])  # type: ignore[arg-type]
    finally:
        os.close(fd)
    with pytest.raises(OSError) as bad:
        _xxh3.pread_xxh3(fd, 0, [], [bytearray(300)])  # closed
    assert bad.value.errno == errno.EBADF


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3000),
    prefix=st.binary(min_size=0, max_size=100),
    src_cuts=st.lists(st.integers(0, 3000), max_size=5),
    dst_cuts=st.lists(st.integers(0, 3000), max_size=5),
)
def test_copy_xxh3_copies_any_cut_into_any_cut_and_hashes_prefix_and_bytes(
    data: bytes, prefix: bytes, src_cuts: list[int], dst_cuts: list[int]
) -> None:
    if _xxh3 is None:
        pytest.fail("hicache.storage._xxh3 is not built")

    def pieces(cuts: list[int]) -> list[tuple[int, int]]:
        points = sorted(min(c, len(data)) for c in cuts)
        return list(zip([0, *points], [*points, len(data)], strict=True))

    sources = [data[a:b] for a, b in pieces(src_cuts)]
    out = bytearray(len(data))
    dests = [memoryview(out)[a:b] for a, b in pieces(dst_cuts)]
    digest = _xxh3.copy_xxh3([prefix], sources, dests)
    assert out == data
    assert digest == (xxhash.xxh3_64_intdigest(prefix + data) if len(prefix) + len(data) > 240 else None)


@needs_ext
def test_copy_xxh3_refuses_unequal_totals_and_read_only_destinations() -> None:
    with pytest.raises(ValueError, match="300 source bytes for 299 destination bytes"):
        _xxh3.copy_xxh3([], [bytes(300)], [bytearray(299)])
    with pytest.raises(BufferError, match="not writable"):
        _xxh3.copy_xxh3([], [bytes(300)], [bytes(300)])
