"""The CUDA paths on a real GPU: device pools in CUDA memory, every host layout, plain and
layer-wise copies (a CUDA event per layer), fp8 and K != V geometries. Skipped without CUDA;
scripts/gpu_check.sh runs them on the lent GPU machine."""

from __future__ import annotations

import pytest
import torch
from conftest import load_config

from hicache.geometry import KVGeometry
from hicache.pools import LAYOUTS, DeviceKVPool, HostKVPool
from hicache.transfer import TransferEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")


def geometry(dtype: str) -> KVGeometry:
    return KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=16, dtype=dtype)


def random_pool(g: KVGeometry, pages: int) -> DeviceKVPool:
    pool = DeviceKVPool(g, pages, "cuda")
    pool.flat.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8, device="cuda"))
    return pool


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_offload_and_reload_are_bit_exact_on_cuda(layout: str, dtype: str) -> None:
    g = geometry(dtype)
    dev, host = random_pool(g, 12), HostKVPool(g, 12, layout)
    want = {p: dev.read_page(p).cpu() for p in (11, 0, 3, 4)}
    with TransferEngine(dev, host) as engine:
        engine.offload([11, 0, 3, 4], [2, 9, 10, 5])
        engine.reload([2, 9, 10, 5], [6, 7, 8, 1])
        torch.cuda.synchronize()
    for src, dst in ((11, 6), (0, 7), (3, 8), (4, 1)):
        assert torch.equal(dev.read_page(dst).cpu(), want[src])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layerwise_reload_records_one_event_per_layer(layout: str) -> None:
    g = geometry("bfloat16")
    dev, host = random_pool(g, 8), HostKVPool(g, 8, layout)
    want = [dev.read_page(p).cpu() for p in (0, 1)]
    with TransferEngine(dev, host) as engine:
        engine.offload([0, 1], [3, 4])
        handle = engine.reload_async([3, 4], [6, 7])
        for layer in range(g.layer_num):
            handle.wait_layer(layer)  # the current stream waits for the layer's event
        handle.wait()
        torch.cuda.synchronize()
    assert torch.equal(dev.read_page(6).cpu(), want[0]) and torch.equal(dev.read_page(7).cpu(), want[1])
