"""The compiled CPU copy path: descriptor building, merging, bounds checks, streaming."""

import itertools
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_config
from helpers import fill_random, same_page

from hicache import DeviceKVPool, HostKVPool, KVGeometry, TransferEngine
from hicache.pools import LAYOUTS
from hicache.transfer import engine as engine_module
from hicache.transfer import native
from hicache.transfer.plan import make_plan

needs_native = pytest.mark.skipif(not native.available(), reason="C extension not built")


def mimo(page_size: int = 4) -> KVGeometry:
    return KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=page_size)


def test_extension_is_built():
    """Where a C compiler exists the install must have built it; otherwise the fast path silently vanishes."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the torch copy path is the documented fallback")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers: the torch copy path is the documented fallback")
    assert native.available(), "hicache.transfer._native is not built: pip install -e . (or make setup) builds it"


def marks_of(batch: native.CopyBatch, size: int, side: int) -> torch.Tensor:
    """How many times each byte of one side (native.DST or native.SRC) is touched."""
    marks = torch.zeros(size, dtype=torch.int32)
    for off, rows, row_bytes, dst_stride, src_stride in batch.descs[:, [side, 2, 3, 4, 5]].tolist():
        stride = dst_stride if side == native.DST else src_stride
        for r in range(rows):
            marks[off + r * stride : off + r * stride + row_bytes] += 1
    return marks


def expected_marks(pool, pages, layers) -> torch.Tensor:
    marks = torch.zeros(pool.nbytes, dtype=torch.int32)
    view = torch.zeros(pool.nbytes, dtype=torch.uint8)
    for page in pages:
        for layer in layers:
            for b in range(len(pool.geometry.buffers)):
                s = pool.layout.strides[b]
                chunk = torch.as_strided(
                    view, (pool.geometry.page_size, s.row_bytes), (s.token_stride, 1), s.offset(page, layer)
                )
                chunk.fill_(1)
    marks += view.to(torch.int32)
    return marks


@pytest.fixture
def sorted_path(monkeypatch):
    """Every transfer takes the path of large ones (sorted, grouped, merged), however small."""
    monkeypatch.setattr(native, "SMALL_BYTES", 0)


@pytest.mark.parametrize("host_layout", LAYOUTS)
@pytest.mark.parametrize("direction", ["offload", "reload"])
def test_a_small_transfer_is_unsorted_chunk_by_chunk_and_still_covers_each_byte_once(host_layout, direction):
    g = mimo()
    dev, host = DeviceKVPool(g, 12), HostKVPool(g, 12, host_layout)
    engine = TransferEngine(dev, host, "torch")
    dev_pages, host_pages = [3, 4, 9], [7, 8, 1]
    src, dst = (dev, host) if direction == "offload" else (host, dev)
    plan = (
        engine.offload_plan(dev_pages, host_pages)
        if direction == "offload"
        else engine.reload_plan(host_pages, dev_pages)
    )
    batch = native.descriptors(src, dst, plan, plan.layers)
    assert batch.nbytes < native.SMALL_BYTES and batch.group == 1
    assert len(batch.descs) == len(dev_pages) * g.layer_num * len(g.buffers)  # one per chunk: no merging
    src_pages, dst_pages = (dev_pages, host_pages) if direction == "offload" else (host_pages, dev_pages)
    assert torch.equal(marks_of(batch, dst.nbytes, native.DST), expected_marks(dst, dst_pages, plan.layers))
    assert torch.equal(marks_of(batch, src.nbytes, native.SRC), expected_marks(src, src_pages, plan.layers))


@pytest.mark.usefixtures("sorted_path")
@pytest.mark.parametrize("host_layout", LAYOUTS)
@pytest.mark.parametrize("direction", ["offload", "reload"])
def test_descriptors_cover_each_chunk_byte_once(host_layout, direction):
    g = mimo()
    dev, host = DeviceKVPool(g, 12), HostKVPool(g, 12, host_layout)
    engine = TransferEngine(dev, host, "torch")
    dev_pages, host_pages, layers = [3, 4, 5, 6, 9, 0], [7, 8, 9, 10, 1, 11], (0, 2, 3, 8)
    if direction == "offload":
        src, dst = dev, host
        plan = engine.offload_plan(dev_pages, host_pages)
        src_pages, dst_pages = dev_pages, host_pages
    else:
        src, dst = host, dev
        plan = engine.reload_plan(host_pages, dev_pages, layers)
        src_pages, dst_pages = host_pages, dev_pages
    batch = native.descriptors(src, dst, plan, plan.layers)
    if host_layout == "page_first" and direction == "reload":  # each row-interleaved group reads one source page
        groups = batch.descs[:, native.SRC].reshape(-1, batch.group) // g.page_bytes
        assert batch.group == len(plan.layers) * len(g.buffers) and (groups == groups[:, :1]).all()
        assert sorted(groups[:, 0].tolist()) == sorted(host_pages)
    else:
        assert batch.group == 1
    assert torch.equal(marks_of(batch, dst.nbytes, native.DST), expected_marks(dst, dst_pages, plan.layers))
    assert torch.equal(marks_of(batch, src.nbytes, native.SRC), expected_marks(src, src_pages, plan.layers))
    assert batch.nbytes == len(dev_pages) * g.page_bytes_for(len(plan.layers))


@pytest.mark.usefixtures("sorted_path")
def test_page_runs_merge_into_one_copy_per_layer_and_buffer():
    g = mimo()
    dev, host = DeviceKVPool(g, 16), HostKVPool(g, 16, "layer_first")
    plan = TransferEngine(dev, host, "torch").offload_plan(list(range(2, 10)), list(range(5, 13)))
    batch = native.descriptors(dev, host, plan, plan.layers)
    assert len(batch.descs) == g.layer_num * len(g.buffers)  # 8 adjacent pages: one copy per (layer, buffer)
    assert (batch.descs[:, native.ROWS] == 1).all()
    assert sorted(set(batch.descs[:, native.ROW_BYTES].tolist())) == sorted(8 * g.chunk_bytes(b) for b in g.buffers)


def test_merge_stops_past_the_cap_and_at_gaps(monkeypatch):
    monkeypatch.setattr(native, "MERGE_CAP", 250)
    rows = [[0, 1000, 1, 100, 100, 100], [100, 1100, 1, 100, 100, 100], [200, 1200, 1, 100, 100, 100]]
    rows += [[300, 1300, 1, 100, 100, 100], [500, 1400, 1, 100, 100, 100], [600, 1500, 4, 10, 20, 10]]
    out = native.merge(np.array(rows, dtype=np.int64))
    assert out[:, [0, 1, 3]].tolist() == [[0, 1000, 300], [300, 1300, 100], [500, 1400, 100], [600, 1500, 10]]
    assert out[3].tolist() == rows[5]  # a strided descriptor never merges


def copy_rows(dst: int, dst_size: int, src: int, src_size: int, descs: np.ndarray, group: int, streaming: bool) -> None:
    """One layer through the C copy, on one thread: the whole descriptor array, no progress word."""
    assert native._native is not None
    ends = np.array([len(descs)], dtype=np.int64)
    native._native.copy_pieces(dst, dst_size, src, src_size, descs, ends, group, streaming, 1, 0, 0)


@needs_native
@pytest.mark.parametrize(
    "desc,message",
    [
        ([0, 0, 2, 8, 60, 8], "descriptor 1 writes past the destination's 64 bytes"),
        ([0, 60, 1, 8, 8, 8], "descriptor 1 reads past the source's 64 bytes"),
        ([-8, 0, 1, 8, 8, 8], "descriptor 1 has a negative field"),
        ([0, 0, (1 << 32) + 1, 8, 1 << 32, 1 << 32], "descriptor 1 writes past"),  # span wraps to 0 in int64
        ([0, 0, 1 << 62, 8, 0, 0], "descriptor 1 writes overlapping rows \\(stride 0 < row 8 bytes\\)"),
    ],
)
def test_copy_rows_checks_every_descriptor_before_copying(desc, message):
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    descs = np.array([[0, 0, 1, 8, 8, 8], desc], dtype=np.int64)
    with pytest.raises(ValueError, match=message):
        copy_rows(dst.data_ptr(), 64, src.data_ptr(), 64, descs, 1, False)
    assert int(dst.count_nonzero()) == 0  # the valid first descriptor was not copied either


@needs_native
def test_copy_rows_rejects_bad_arguments():
    buf = torch.zeros(64, dtype=torch.uint8)
    copy = copy_rows
    with pytest.raises(ValueError, match="shape \\(n, 6\\)"):
        copy(buf.data_ptr(), 64, buf.data_ptr(), 64, np.zeros((1, 5), dtype=np.int64), 1, False)
    with pytest.raises(ValueError, match="int64 array"):
        copy(buf.data_ptr(), 64, buf.data_ptr(), 64, np.zeros((1, 6), dtype=np.int32), 1, False)
    with pytest.raises(ValueError, match="group must be >= 1, got 0"):
        copy(buf.data_ptr(), 64, buf.data_ptr(), 64, np.zeros((1, 6), dtype=np.int64), 0, False)
    one = np.array([[0, 0, 1, 8, 8, 8]], dtype=np.int64)
    with pytest.raises(ValueError, match="non-zero"):
        copy(0, 64, buf.data_ptr(), 64, one, 1, False)
    with pytest.raises(OverflowError):
        copy(-16, 64, buf.data_ptr(), 64, one, 1, False)
    with pytest.raises(OverflowError):
        copy(buf.data_ptr(), 64, 1 << 64, 64, one, 1, False)
    big_endian = np.zeros((1, 6), dtype=">i8" if np.little_endian else "<i8")
    with pytest.raises(ValueError, match="int64 array"):
        copy(buf.data_ptr(), 64, buf.data_ptr(), 64, big_endian, 1, False)
    copy(buf.data_ptr(), 64, buf.data_ptr(), 64, np.array([[0, 8, 1 << 62, 0, 0, 0]]), 1, False)  # no bytes: no work


@needs_native
@pytest.mark.parametrize("streaming", [False, True])
def test_copy_rows_unaligned_rows_and_groups(streaming):
    """Odd offsets, strides and widths (head, 64-byte body, tail) in row-interleaved groups."""
    rng = np.random.default_rng(0)
    src = torch.from_numpy(rng.integers(0, 256, 4096, dtype=np.uint8))
    dst = torch.zeros(8192, dtype=torch.uint8)
    descs = np.array([[3, 1, 3, 133, 1001, 141], [405, 700, 2, 77, 300, 90], [7000, 2000, 1, 1000, 1000, 1000]])
    copy_rows(dst.data_ptr(), 8192, src.data_ptr(), 4096, descs, 2, streaming)
    want = torch.zeros(8192, dtype=torch.uint8)
    for d, s, rows, n, ds, ss in descs.tolist():
        for r in range(rows):
            want[d + r * ds : d + r * ds + n] = src[s + r * ss : s + r * ss + n]
    assert torch.equal(dst, want)


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "fp4_e2m1"])
def test_streaming_threaded_roundtrip_is_bit_exact(layout, dtype, monkeypatch):
    """The large-transfer path (non-temporal stores, pieces on several copy threads) on a small pool."""
    monkeypatch.setattr(native, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(native, "SMALL_BYTES", 0)
    monkeypatch.setattr(native, "SHARE_MIN_BYTES", 0)
    monkeypatch.setattr(native, "PIECE_BYTES", 64)
    threads: list[int] = []
    copy_pieces = native._native.copy_pieces  # type: ignore[union-attr]

    def counted(*args):  # type: ignore[no-untyped-def]
        threads.append(args[8])
        return copy_pieces(*args)

    monkeypatch.setattr(native._native, "copy_pieces", counted)
    g = KVGeometry(layer_num=3, head_num=3, head_dim=48, v_head_dim=16, page_size=5, dtype=dtype)
    dev = DeviceKVPool(g, 9)
    fill_random(dev, 7)
    host = HostKVPool(g, 9, layout)
    with TransferEngine(dev, host, "native", copy_threads=3) as engine:
        assert engine.backend == "native"
        engine.offload([8, 0, 1, 2, 4], [3, 4, 5, 0, 8])
        back = DeviceKVPool(g, 9)
        with TransferEngine(back, host, "native", copy_threads=3) as loader:
            loader.reload([3, 4, 5, 0, 8], [1, 2, 3, 7, 0], layers=[0, 2])
    assert threads == [3, 3]  # both transfers were copied on the copy threads
    for d, t in zip([8, 0, 1, 2, 4], [1, 2, 3, 7, 0], strict=True):
        assert same_page(dev, d, back, t, layers=[0, 2])
    assert int(back.chunks(0, 0, 1, 9, 1).count_nonzero()) == 0  # layer 1 was not reloaded


def test_auto_backend_and_unavailable_native(monkeypatch, caplog):
    g = KVGeometry(layer_num=1, head_num=1, head_dim=16, v_head_dim=8)
    dev, host = DeviceKVPool(g, 2), HostKVPool(g, 2)
    assert TransferEngine(dev, host).backend == ("native" if native.available() else "torch")
    monkeypatch.setattr(native, "_native", None)
    engine_module._warn_torch_fallback.cache_clear()
    assert TransferEngine(dev, host).backend == "torch"
    assert "CPU copies use the slower torch path" in caplog.text
    with pytest.raises(ValueError, match="backend 'native' is not available .*_native is not built"):
        TransferEngine(dev, host, "native")


@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "fp4_e2m1"])
def test_a_small_transfers_template_descriptors_are_the_chunks_of_its_pages(src_layout, dst_layout, dtype):
    """The cached page template, moved to each page, gives the same chunks (as a set) as
    computing every chunk from the strides, for any pages and any subset of layers."""
    g = KVGeometry(layer_num=4, head_num=2, head_dim=32, v_head_dim=16, page_size=4, dtype=dtype)
    src, dst = HostKVPool(g, 10, src_layout), HostKVPool(g, 10, dst_layout)
    rng = np.random.default_rng(len(src_layout) * 7 + len(dst_layout))
    for pages in (1, 3, 6):
        for layers in ((0, 1, 2, 3), (1, 3), (2,)):
            s_pages, d_pages = rng.permutation(10)[:pages], rng.permutation(10)[:pages]
            plan = make_plan(s_pages, 10, d_pages, 10, g.layer_num, layers, ("src", "dst"))
            small = native.small_descriptors(src, dst, plan, layers)
            full = np.concatenate(native.chunk_parts(src, dst, plan, np.asarray(layers, dtype=np.int64)))
            assert sorted(map(tuple, small.tolist())) == sorted(map(tuple, full.tolist()))


@needs_native
@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "fp4_e2m1"])
@pytest.mark.parametrize("threads", [1, 3])
def test_copy_small_moves_exactly_the_chosen_pages_and_layers(src_layout, dst_layout, dtype, threads, monkeypatch):
    """The one-call small path (the template moved to each page pair in C) writes the chosen
    layers of the destination pages with the source pages' bytes and nothing else, and
    publishes every layer into its progress word; on one thread, or in small pieces on three."""
    monkeypatch.setattr(native, "PIECE_BYTES", 64)
    g = KVGeometry(layer_num=4, head_num=2, head_dim=32, v_head_dim=16, page_size=4, dtype=dtype)
    src, dst = HostKVPool(g, 10, src_layout), HostKVPool(g, 10, dst_layout)
    fill_random(src, 1)
    rng = np.random.default_rng(len(src_layout) * 7 + len(dst_layout))
    word = np.zeros(1, dtype=np.uint32)
    for pages in (0, 1, 3):
        for layers in ((0, 1, 2, 3), (3, 1), (2,)):
            fill_random(dst, 2)
            before = dst.flat.clone()
            s_pages, d_pages = rng.permutation(10)[:pages], rng.permutation(10)[:pages]
            plan = make_plan(s_pages, 10, d_pages, 10, g.layer_num, layers, ("src", "dst"))
            word[0] = 0
            native.small_copy(src, dst, plan.layers)(plan.src_pages, plan.dst_pages, word.ctypes.data, threads)
            assert int(word[0]) == len(plan.layers)
            for s_page, d_page in zip(s_pages.tolist(), d_pages.tolist(), strict=True):
                assert same_page(src, s_page, dst, d_page, list(layers))
            untouched = torch.ones(dst.nbytes, dtype=torch.bool)
            untouched[expected_marks(dst, d_pages.tolist(), layers) > 0] = False
            assert torch.equal(dst.flat[untouched], before[untouched])


@needs_native
def test_one_engine_copies_each_of_more_layer_sets_than_it_keeps_copies_for():
    """The engine makes each small copy once per (direction, layer set) and keeps at most 64:
    over 127 layer sets in both directions (past the bound, so it starts again), each reload
    writes exactly its layers of the page, and offloads after it still copy every layer."""
    g = KVGeometry(layer_num=7, head_num=1, head_dim=16, v_head_dim=8, page_size=2)
    dev, host = DeviceKVPool(g, 3), HostKVPool(g, 2, "page_first")
    fill_random(dev, 4)
    with TransferEngine(dev, host, "native") as engine:
        engine.offload([0], [1])
        for count in range(1, g.layer_num + 1):
            for layers in itertools.combinations(range(g.layer_num), count):
                fill_random(dev, 5 + count)  # page 0 changes too: the next offload must carry it
                before = dev.flat.clone()
                engine.reload([1], [2], layers=list(layers))
                untouched = torch.ones(dev.nbytes, dtype=torch.bool)
                untouched[expected_marks(dev, [2], layers) > 0] = False
                assert torch.equal(dev.flat[untouched], before[untouched]), layers
                assert same_page(host, 1, dev, 2, list(layers)), layers
                engine.offload([0], [1])
                assert same_page(dev, 0, host, 1), layers


@needs_native
def test_copy_small_refuses_a_page_outside_either_pool_before_copying_anything():
    g = mimo()
    src, dst = HostKVPool(g, 8), HostKVPool(g, 4)
    fill_random(src, 3)
    before = dst.flat.clone()
    past = make_plan([1, 7], 8, [0, 7], 8, g.layer_num)  # destination page 7 of a 4-page pool
    with pytest.raises(ValueError, match="writes past the destination's"):
        native.small_copy(src, dst, past.layers)(past.src_pages, past.dst_pages)
    assert torch.equal(dst.flat, before)  # page pair 0 was valid, and not copied either
    t = native.page_template(src.layout, dst.layout, g.page_size, (0, 1))
    args = (dst.flat.data_ptr(), dst.nbytes, src.flat.data_ptr(), src.nbytes, t.descs, t.src_stride, t.dst_stride)
    with pytest.raises(ValueError, match=r"page pair 0 \(-1 -> 0\) is out of range"):
        native._native.copy_pages(*args, np.array([-1]), np.array([0]), 2, False, 1, 0, 0)
    with pytest.raises(ValueError, match="as many destination as source pages; got 4 rows, 4 and 4 steps, 2 and 1"):
        native._native.copy_pages(*args, np.array([0, 1]), np.array([0]), 2, False, 1, 0, 0)
    with pytest.raises(ValueError, match="buffers x 3 layers rows"):
        native._native.copy_pages(*args, np.array([0]), np.array([0]), 3, False, 1, 0, 0)
    none = np.zeros(0, dtype=np.int64)
    with pytest.raises(ValueError, match=f"buffers x {2**61} layers rows"):  # no rows to hold them: refused, not run
        native._native.copy_pages(
            *args[:4], np.zeros((0, 6), dtype=np.int64), none, none, none, none, 2**61, False, 1, 0, 0
        )
    with pytest.raises(ValueError, match="not C-contiguous"):
        native._native.copy_pages(*args, np.array([0, 1, 2, 3])[::2], np.array([0, 1]), 2, False, 1, 0, 0)
    assert torch.equal(dst.flat, before)


@needs_native
@pytest.mark.parametrize("layerwise", [False, True])
def test_a_one_thread_transfer_of_strided_page_lists_copies_each_pair(layerwise):
    """Page lists the caller gives as strided int64 views (kept as they are by the plan) take
    the one-call small path like any other."""
    g = mimo()
    dev, host = DeviceKVPool(g, 16), HostKVPool(g, 16)
    fill_random(host, 4)
    engine = TransferEngine(dev, host, "native", copy_threads=1)
    host_pages, dev_pages = np.arange(12, dtype=np.int64)[::3], np.arange(8, dtype=np.int64)[::2]
    if layerwise:
        engine.reload_async(host_pages, dev_pages).wait(30)
    else:
        engine.reload(host_pages, dev_pages)
    for h, d in zip(host_pages.tolist(), dev_pages.tolist(), strict=True):
        assert same_page(host, h, dev, d)
    engine.close()
