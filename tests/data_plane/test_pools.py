import os
import stat
import subprocess
import sys

import pytest
import torch
from conftest import load_config
from helpers import fill_random, same_page

from hicache import DeviceKVPool, HostKVPool, KVGeometry
from hicache.memory import create_shm, open_shm, shm_dir
from hicache.pools import LAYOUTS

MIMO = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=16)
DTYPES = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "fp4_e2m1"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_nbytes_is_formula(dtype, layout):
    g = KVGeometry(**dict(MIMO.to_dict(), dtype=dtype))
    pool = HostKVPool(g, 5, layout)
    assert pool.nbytes == 5 * g.page_bytes
    pool.check_integrity()


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_buffers_shapes(dtype):
    g = KVGeometry(**dict(MIMO.to_dict(), dtype=dtype))
    pool = DeviceKVPool(g, 3)
    assert pool.nbytes == 3 * g.page_bytes
    k, v = pool.k_buffer(2), pool.v_buffer(2)
    slots = 3 * g.page_size
    storage = torch.uint8 if dtype.startswith(("float8", "fp4")) else getattr(torch, dtype)
    assert k.dtype == v.dtype == storage
    width = 2 if dtype == "fp4_e2m1" else 1
    assert k.shape == (slots, 4, 192 // width) and v.shape == (slots, 4, 128 // width)
    if dtype == "fp4_e2m1":
        assert pool.buffer(0, "k_scale").shape == (slots, 4, 12)
        assert pool.buffer(0, "v_scale").shape == (slots, 4, 8)
        assert len(pool.layer_buffers(0)) == 4
    pool.check_integrity()


def test_layer_buffers_are_disjoint_views():
    pool = DeviceKVPool(MIMO, 2)
    pool.k_buffer(1).fill_(1.0)
    assert pool.v_buffer(1).abs().sum() == 0 and pool.k_buffer(0).abs().sum() == 0
    assert pool.k_buffer(1)[pool.page_slots(1)].shape == (16, 4, 192)


def test_mla_device_pool():
    g = KVGeometry.from_hf_config(load_config("deepseek_v3"), page_size=4)
    pool = DeviceKVPool(g, 2)
    assert pool.k_buffer(60).shape == (8, 1, 576)
    with pytest.raises(ValueError, match="an MLA pool has no V buffer"):
        pool.v_buffer(0)


def test_pool_errors():
    with pytest.raises(ValueError, match="num_pages must be >= 1, got 0"):
        DeviceKVPool(MIMO, 0)
    with pytest.raises(ValueError, match="unknown layout 'tiled'"):
        HostKVPool(MIMO, 2, "tiled")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        DeviceKVPool(MIMO, 2, device="tpu")
    pool = DeviceKVPool(MIMO, 2)
    with pytest.raises(ValueError, match="layer 9 out of range"):
        pool.layer_buffers(9)
    with pytest.raises(ValueError, match="no buffer 'k_scale'"):
        pool.buffer(0, "k_scale")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_page_roundtrip_across_layouts(dtype, layout):
    g = KVGeometry(**dict(MIMO.to_dict(), dtype=dtype))
    src = HostKVPool(g, 3, layout)
    fill_random(src, seed=3)
    page = src.read_page(1)
    assert page.numel() == g.page_bytes
    for other in LAYOUTS:  # the flat format does not depend on the layout
        dst = HostKVPool(g, 3, other)
        dst.write_page(2, page)
        assert same_page(src, 1, dst, 2)
        assert torch.equal(dst.read_page(2), page)
        assert int(dst.read_page(0).count_nonzero()) == 0


def test_page_first_direct_page_is_contiguous_slice():
    pool = HostKVPool(MIMO, 3, "page_first_direct")
    fill_random(pool)
    pb = MIMO.page_bytes
    assert torch.equal(pool.read_page(1), pool.flat[pb : 2 * pb])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_write_page_from_every_kind_of_buffer(layout):
    """A writable view is wrapped where it lies (a tier's reused buffer, at an offset);
    bytes and a strided view are copied first. Each lands as the same page."""
    pool = HostKVPool(MIMO, 4, layout)
    pb = MIMO.page_bytes
    page = torch.randint(0, 256, (pb,), dtype=torch.uint8).numpy().tobytes()
    arena = bytearray(3 * pb)
    arena[pb : 2 * pb] = page
    strided = memoryview(bytearray(b"".join(bytes([b, 0]) for b in page)))[::2]
    for i, data in enumerate([memoryview(arena)[pb : 2 * pb], page, strided, bytearray(page)]):
        pool.write_page(i, data)
        assert bytes(pool.read_page(i).numpy()) == page, type(data)
    assert bytes(arena[pb : 2 * pb]) == page  # the source is read, never written


def test_write_page_errors_leave_pool_untouched():
    pool = HostKVPool(MIMO, 2)
    fill_random(pool)
    before = pool.flat.clone()
    with pytest.raises(ValueError, match=f"page data must be {MIMO.page_bytes} uint8 bytes, got 10"):
        pool.write_page(0, b"0123456789")
    with pytest.raises(ValueError, match="page 2 out of range"):
        pool.write_page(2, bytes(MIMO.page_bytes))
    with pytest.raises(ValueError, match="page -1 out of range"):
        pool.read_page(-1)
    assert torch.equal(pool.flat, before)


def test_shm_is_private_and_unlinked_on_close():
    buf = create_shm(4096)
    path = os.path.join(shm_dir(), buf.handle.name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    buf.close()
    assert not os.path.exists(path)


def test_open_shm_errors():
    buf = create_shm(128)
    with pytest.raises(ValueError, match="holds 128 bytes, expected 64"):
        open_shm(buf.handle.name, 64)
    with pytest.raises(ValueError, match="invalid shared-memory name '../etc/passwd'"):
        open_shm("../etc/passwd", 64)
    buf.close()
    with pytest.raises(FileNotFoundError):
        open_shm(buf.handle.name, 128)


def test_device_pool_shared_with_another_process():
    pool = DeviceKVPool(MIMO, 2)
    script = (
        "import sys, json; from hicache import KVGeometry, DeviceKVPool; from hicache.memory import MemoryHandle\n"
        "g = KVGeometry(**json.loads(sys.argv[1])); h = MemoryHandle('shm', int(sys.argv[3]), name=sys.argv[2])\n"
        "p = DeviceKVPool.attach(g, 2, h); p.v_buffer(8)[3] = 7.0\n"
    )
    import json

    subprocess.run(
        [sys.executable, "-c", script, json.dumps(MIMO.to_dict()), pool.handle.name, str(pool.nbytes)], check=True
    )
    assert bool((pool.v_buffer(8)[3] == 7.0).all()) and float(pool.v_buffer(8)[4].abs().sum()) == 0.0
    # the attaching process did not unlink the segment
    assert os.path.exists(os.path.join(shm_dir(), pool.handle.name))
    pool.close()


def test_host_pool_attach():
    pool = HostKVPool(MIMO, 2, "page_first")
    fill_random(pool)
    other = HostKVPool.attach(MIMO, 2, "page_first", pool.handle)
    assert torch.equal(other.read_page(1), pool.read_page(1))
    with pytest.raises(ValueError, match="holds .* bytes, expected"):
        HostKVPool.attach(MIMO, 3, "page_first", pool.handle)


def test_pages_written_from_views_and_pools_over_views_address_their_own_bytes():
    """A view starts past its storage's first byte: page copies count from the view, not the
    storage (the GPU check found write_page(p, batch[p]) writing batch[0]'s bytes)."""
    from hicache.memory import wrap_tensor
    from hicache.pools.flat import FlatPool
    from hicache.pools.layouts import make_layout

    g = KVGeometry(layer_num=2, head_num=1, head_dim=8, v_head_dim=4, page_size=2)
    dev = DeviceKVPool(g, 3)
    batch = torch.randint(0, 256, (3, g.page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    for p in range(3):
        dev.write_page(p, batch[p])
    assert all(torch.equal(dev.read_page(p), batch[p]) for p in range(3))
    backing = torch.zeros(100 + g.pool_bytes(3), dtype=torch.uint8)
    inner = FlatPool(g, make_layout("page_first", g, 3), wrap_tensor(backing[100:]))
    for p in range(3):
        inner.write_page(p, batch[p])
    assert int(backing[:100].count_nonzero()) == 0  # nothing before the view was touched
    assert all(torch.equal(inner.read_page(p), batch[p]) for p in range(3))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "g",
    [
        KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=4, dtype="fp4_e2m1"),  # K, V and scales
        KVGeometry(attention="mla", layer_num=3, head_num=1, kv_lora_rank=64, qk_rope_head_dim=16, page_size=2),
    ],
    ids=["mimo_fp4", "mla"],
)
def test_page_pieces_are_the_page_in_canonical_order_and_write_through(g, layout):
    pool = HostKVPool(g, 5, layout)
    fill_random(pool, 3)
    pieces = pool.page_pieces(3)
    assert pieces is not None and all(not p.readonly for p in pieces)
    assert b"".join(pieces) == pool.read_page(3).numpy().tobytes()
    if layout != "page_first":  # whole chunks: one piece per (layer, buffer), fewer where they touch
        assert len(pieces) <= g.layer_num * len(g.buffers)
    fresh = bytes(range(256)) * (g.page_bytes // 256) + bytes(g.page_bytes % 256)
    before = pool.flat.clone()
    at = 0
    for piece in pieces:
        piece[:] = fresh[at : at + piece.nbytes]
        at += piece.nbytes
    assert pool.read_page(3).numpy().tobytes() == fresh
    ref = HostKVPool(g, 5, layout)
    ref.flat.copy_(before)
    ref.write_page(3, fresh)
    assert torch.equal(pool.flat, ref.flat)  # exactly write_page's bytes, no other page touched
    with pytest.raises(ValueError, match=r"page 5 out of range \[0, 5\)"):
        pool.page_pieces(5)
    del pieces
    pool.close()
    with pytest.raises(ValueError, match="the pool's memory is closed"):
        pool.page_pieces(0)


def test_page_pieces_give_way_to_write_page_for_many_small_rows():
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=64)
    assert HostKVPool(g, 2, "page_first").page_pieces(0) is None  # 64 tokens x 9 layers x 2 buffers rows
    assert len(HostKVPool(g, 2, "layer_first").page_pieces(1) or []) == 18
    assert len(HostKVPool(g, 2, "page_first_direct").page_pieces(1) or []) == 1  # the page is one block
