"""Triton kernels on the CPU under TRITON_INTERPRET=1, checked against the torch path."""

import os

import pytest
from conftest import load_config
from test_transfer import roundtrip

from hicache import KVGeometry
from hicache.pools import LAYOUTS

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "fp4_e2m1"])
def test_triton_matches_torch_mimo(layout, dtype):
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=2, dtype=dtype)
    g = KVGeometry(**dict(g.to_dict(), layer_num=3, layer_ids=g.layer_ids[:3]))
    roundtrip(g, layout, backend="triton")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_mla(layout):
    g = KVGeometry(attention="mla", layer_num=2, head_num=1, kv_lora_rank=64, qk_rope_head_dim=16, page_size=3)
    roundtrip(g, layout, backend="triton")


def test_triton_odd_widths_use_byte_words():
    g = KVGeometry(layer_num=2, head_num=3, head_dim=5, v_head_dim=3, page_size=3, dtype="float8_e5m2")
    for layout in LAYOUTS:
        roundtrip(g, layout, backend="triton")


def test_triton_layerwise_async_reload():
    from helpers import fill_random, same_page

    from hicache import DeviceKVPool, HostKVPool, TransferEngine

    g = KVGeometry(layer_num=3, head_num=2, head_dim=32, v_head_dim=16, page_size=2)
    dev = DeviceKVPool(g, 4)
    fill_random(dev, 1)
    host = HostKVPool(g, 4, "page_first")
    with TransferEngine(dev, host, backend="triton") as engine:
        engine.offload_async([0, 3], [2, 1]).wait()
        back = DeviceKVPool(g, 4)
        with TransferEngine(back, host, backend="triton") as loader:
            handle = loader.reload_async([2, 1], [1, 2], layers=[0, 2])
            handle.wait_layer(0)
            assert same_page(dev, 0, back, 1, layers=[0])
            handle.wait()
    assert same_page(dev, 0, back, 1, layers=[0, 2]) and same_page(dev, 3, back, 2, layers=[0, 2])
    assert int(back.k_buffer(1).count_nonzero()) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_chunks_cut_into_rows_are_copied_whole(layout, monkeypatch):
    """A 7680-byte K chunk becomes 15 rows of 512 bytes, copied in tiles of 2 rows (the last
    tile half masked); strided chunks keep a row per token."""
    from hicache.transfer import triton_kernels

    monkeypatch.setattr(triton_kernels, "WHOLE_ROW_BYTES", 512)
    monkeypatch.setattr(triton_kernels, "TILE_WORDS", 256)
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=5)
    g = KVGeometry(**dict(g.to_dict(), layer_num=2, layer_ids=g.layer_ids[:2]))
    roundtrip(g, layout, backend="triton")
