"""The copy paths below the engine: the threaded CPU copier and the CUDA path's memcpy planning."""

import pytest
import torch
from conftest import load_config
from helpers import fill_random, same_page

from hicache import DeviceKVPool, HostKVPool, KVGeometry, TransferEngine
from hicache.pools import LAYOUTS
from hicache.transfer.cpu import CpuCopier, copy_views, full_views, split_shares
from hicache.transfer.cuda import choose_path, copy_segments, mean_piece_bytes, memcpy_segments


def mimo(page_size: int = 8) -> KVGeometry:
    return KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=page_size)


def test_split_shares_covers_every_byte_once():
    g = mimo()
    dev, host = DeviceKVPool(g, 12), HostKVPool(g, 12, "page_first")
    engine = TransferEngine(dev, host)
    plan = engine.offload_plan([0, 1, 2, 3, 4, 5, 9], [6, 7, 8, 9, 10, 11, 0])  # one long run, one single
    dsts, srcs = copy_views(full_views(dev), full_views(host), plan)
    shares = split_shares(dsts, srcs, 3)
    assert len(shares) == 3
    sizes = [sum(d.numel() for d in share[0]) for share in shares]
    assert sum(sizes) == sum(d.numel() for d in dsts) == plan.num_pages * g.page_bytes
    assert max(sizes) <= 2 * min(sizes)  # the long run was cut, so the shares balance
    marks = torch.zeros(host.nbytes, dtype=torch.int32)
    for share in shares:
        for d in share[0]:
            offset = d.storage_offset()
            view = torch.as_strided(marks, d.shape, d.stride(), offset)
            view += 1
    assert int(marks.max()) == 1 and int(marks.sum()) == plan.num_pages * g.page_bytes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_threaded_copier_is_bit_exact(layout):
    g = mimo(page_size=64)  # 1.47 MB pages: 6 of them are big enough for the copy threads
    dev = DeviceKVPool(g, 10)
    fill_random(dev, 4)
    host = HostKVPool(g, 10, layout)
    fill_random(host, 5)
    host_before = host.flat.clone()
    threads_before = torch.get_num_threads()
    with TransferEngine(dev, host, "torch", copy_threads=3) as engine:  # the native path threads in C
        dev_pages, host_pages = [9, 0, 1, 2, 5, 7], [1, 2, 3, 4, 8, 0]
        engine.offload(dev_pages, host_pages)
        assert engine._copier is not None and engine._copier.threads == 3
    assert torch.get_num_threads() == threads_before  # the copy threads' setting stays theirs
    for d, h in zip(dev_pages, host_pages, strict=True):
        assert same_page(dev, d, host, h)
    ref = HostKVPool(g, 10, layout)
    ref.flat.copy_(host_before)
    for h in (5, 6, 7, 9):
        assert same_page(host, h, ref, h)


def test_copier_reraises_copy_errors():
    copier = CpuCopier(2)
    big = torch.zeros(4 << 20, dtype=torch.uint8)
    overlapping = torch.zeros(1, 1, 1, 1, dtype=torch.uint8).expand(4, 1, 1, 1 << 20)  # every element aliased
    with pytest.raises(RuntimeError, match="single memory location"):
        copier.run([overlapping], [big.view(4, 1, 1, 1 << 20)])
    copier.close()
    copier.run([big[:10]], [torch.ones(10, dtype=torch.uint8)])  # closed: copies inline
    assert int(big[:10].sum()) == 10
    with pytest.raises(ValueError, match="threads must be an int >= 1, got 0"):
        CpuCopier(0)


def test_engine_rejects_bad_copy_threads():
    g = KVGeometry(layer_num=1, head_num=1, head_dim=16, v_head_dim=8)
    with pytest.raises(ValueError, match="copy_threads must be an int >= 1 or None, got 0"):
        TransferEngine(DeviceKVPool(g, 1), HostKVPool(g, 1), copy_threads=0)


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("dtype", ["bfloat16", "fp4_e2m1"])
def test_memcpy_segments_carry_out_the_plan(layout, dtype):
    """The CUDA memcpy path's byte ranges, applied with plain copies on CPU, equal the torch path."""
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=4, dtype=dtype)
    dev = DeviceKVPool(g, 8)
    fill_random(dev, 1)
    host = HostKVPool(g, 8, layout)
    engine = TransferEngine(dev, host)
    plan = engine.offload_plan([0, 1, 2, 6, 4], [3, 4, 5, 0, 7])
    segments = memcpy_segments(dev, host, plan, plan.layers)
    assert segments is not None
    if layout == "layer_first":  # the run 0,1,2 -> 3,4,5 is one range per (layer, buffer)
        assert len(segments) == g.layer_num * len(g.buffers) * 3
    copy_segments(dev, host, segments)
    for d, h in zip(plan.src_pages, plan.dst_pages, strict=True):
        assert same_page(dev, int(d), host, int(h))
    back = DeviceKVPool(g, 8)
    rplan = engine.reload_plan([3, 7], [2, 5], layers=[1, 3])
    rsegs = memcpy_segments(host, back, rplan, rplan.layers)
    assert rsegs is not None
    copy_segments(host, back, rsegs)
    assert same_page(dev, 0, back, 2, layers=[1, 3]) and same_page(dev, 4, back, 5, layers=[1, 3])
    assert int(back.k_buffer(0).count_nonzero()) == 0


def test_stream_hooks_are_refused_on_cpu_pools_before_anything_is_copied():
    g = mimo(page_size=8)
    dev, host = DeviceKVPool(g, 4), HostKVPool(g, 4)
    fill_random(dev, seed=3)
    with TransferEngine(dev, host) as engine:
        with pytest.raises(ValueError, match="ready is for CUDA pools"):
            engine.offload([0], [1], ready=lambda stream: None)
        with pytest.raises(ValueError, match="after_layer is for CUDA pools"):
            engine.reload_async([0], [1], after_layer=lambda position, stream: None)
        assert int(host.flat.count_nonzero()) == 0


def test_memcpy_path_needs_contiguous_chunks_and_large_pieces():
    g = mimo(page_size=64)
    dev = DeviceKVPool(g, 4)
    strided = HostKVPool(g, 4, "page_first")  # rows of a chunk are a token stride apart
    direct = HostKVPool(g, 4, "page_first_direct")
    plan = TransferEngine(dev, direct).offload_plan([0, 1], [2, 3])
    assert memcpy_segments(dev, strided, plan, plan.layers) is None
    assert mean_piece_bytes(dev, strided, plan) is None
    assert choose_path(None) == "kernel"
    mean = mean_piece_bytes(dev, direct, plan)
    assert mean == (96 + 64) * 1024 / 2  # one 96 KiB K and one 64 KiB V chunk per page
    assert choose_path(mean, min_bytes=64 << 10) == "memcpy"
    assert choose_path(mean, min_bytes=1 << 20) == "kernel"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pages", [[0, 1, 2, 3, 7], [5, 2, 6, 0], [1]])
def test_the_counted_mean_piece_is_that_of_the_listed_pieces(layout: str, pages: list[int]) -> None:
    g = mimo(page_size=16)
    dev, host = DeviceKVPool(g, 8), HostKVPool(g, 8, layout)
    plan = TransferEngine(dev, host).offload_plan(pages, [7 - p for p in pages][::-1])
    segments = memcpy_segments(dev, host, plan, plan.layers)
    mean = mean_piece_bytes(dev, host, plan)
    if segments is None:
        assert mean is None
    else:
        assert mean == sum(n for _, _, n in segments) / len(segments)


def test_the_group_copier_copies_exactly_its_layer_group_by_memcpy():
    """Long page runs between layer_first pools: memcpy, one layer group at a time."""
    from hicache.transfer.cuda import group_copier

    g = mimo(page_size=64)  # 96 / 64 KiB chunks; a run of 8 pages is one 768 / 512 KiB piece
    dev, host = DeviceKVPool(g, 16), HostKVPool(g, 16, "layer_first")
    fill_random(dev, 9)
    plan = TransferEngine(dev, host).offload_plan(list(range(8)) + [12], list(range(4, 12)) + [0])
    copy = group_copier(dev, host, plan, "auto")
    assert copy(slice(2, 3)) == "memcpy" and copy(slice(0, 1)) == "memcpy"
    for d, h in zip(plan.src_pages.tolist(), plan.dst_pages.tolist(), strict=True):
        assert same_page(dev, d, host, h, layers=[0, 2])
        assert not same_page(dev, d, host, h, layers=[1])  # not copied yet
    assert copy(slice(1, g.layer_num)) == "memcpy"
    for d, h in zip(plan.src_pages.tolist(), plan.dst_pages.tolist(), strict=True):
        assert same_page(dev, d, host, h)
    assert all(int(host.read_page(p).count_nonzero()) == 0 for p in (1, 2, 3, 12, 13, 14, 15))  # outside the plan
