"""The demo's pieces without a sidecar: its device cache, workload, model and config cuts."""

from __future__ import annotations

import pytest
import torch

from hicache.demo import load_config, model_geometries, truncate_layers
from hicache.demo.device_cache import DeviceCache
from hicache.demo.model import ToyModel
from hicache.demo.workload import ChatWorkload
from hicache.pools import DeviceKVPool


def test_device_cache_evicts_lru_unreferenced_pages_only():
    c = DeviceCache(4)
    pages = c.allocate(3)
    assert pages == [0, 1, 2]
    for key, page in zip((b"a", b"b", b"c"), pages, strict=True):
        c.insert(key, page)
    c.release(pages)
    c.acquire([b"a"])  # "a" becomes most recent and referenced
    c.check_integrity()
    assert sorted(c.allocate(3)) == [1, 2, 3] and c.evictions == 2  # free page 3, then "b" and "c"
    assert b"a" in c and b"b" not in c and c.prefix_length([b"a", b"b"]) == 1
    assert c.allocate(1) is None  # "a" is referenced, the rest is scratch
    c.release([0, 3, 1, 2])
    c.check_integrity()
    assert c.available == 4
    with pytest.raises(KeyError, match="page 0"):
        c.release([0])
    with pytest.raises(ValueError, match="num_pages"):
        DeviceCache(0)


def test_workload_grows_conversations_that_share_the_system_prompt():
    w = ChatWorkload(conversations=3, turns=2, system_tokens=10, turn_tokens=(5, 5), seed=1)
    reqs = w.requests()
    assert len(reqs) == 6 and w.max_tokens == 20
    assert all(len(r.tokens) == 10 + 5 * (r.turn + 1) for r in reqs)
    assert len({r.tokens[:10].tobytes() for r in reqs}) == 1
    by_conv = {(r.conversation, r.turn): r.tokens for r in reqs}
    assert all((by_conv[c, 1][:15] == by_conv[c, 0]).all() for c in range(3))
    assert [r.tokens.tolist() for r in reqs] == [r.tokens.tolist() for r in w.requests()]
    with pytest.raises(ValueError, match="turn_tokens"):
        ChatWorkload(turn_tokens=(5, 2))


def test_truncate_layers_keeps_the_per_layer_geometry():
    cfg = truncate_layers(load_config(None), 6)
    g = model_geometries(cfg, tp_size=1, page_size=16, dtype="bfloat16")
    assert (g["full"].layer_ids, g["swa"].layer_ids) == ((0, 5), (1, 2, 3, 4))
    assert (g["full"].head_dim, g["full"].v_head_dim, g["swa"].head_num) == (192, 128, 8)
    with pytest.raises(ValueError, match="layers must be"):
        truncate_layers(cfg, 7)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_model_with_a_cached_prefix_gives_the_same_bits_as_from_scratch(dtype):
    geometries = model_geometries(truncate_layers(load_config(None), 6), tp_size=1, page_size=16, dtype=dtype)
    model = ToyModel(geometries, window=24)
    a = {n: DeviceKVPool(g, 6) for n, g in geometries.items()}
    b = {n: DeviceKVPool(g, 6) for n, g in geometries.items()}
    tokens = torch.arange(75) * 7
    ref = model.prefill(a, [0, 1, 2, 3, 4], tokens, 0)
    for name in geometries:  # pages 0-1 cached elsewhere, in pages 5 and 3
        b[name].write_page(5, a[name].read_page(0))
        b[name].write_page(3, a[name].read_page(1))
    got = model.prefill(b, [5, 3, 0, 1, 2], tokens, 32)
    assert all(torch.equal(x[32:], y) for x, y in zip(ref, got, strict=True))
    assert all(torch.equal(a[n].read_page(4), b[n].read_page(2)) for n in geometries)
    with pytest.raises(ValueError, match="page multiple"):
        model.prefill(b, [0, 1, 2, 3, 4], tokens, 5)
    for pools in (a, b):
        for p in pools.values():
            p.close()


def test_model_refuses_fp4():
    geometries = model_geometries(load_config(None), tp_size=1, page_size=16, dtype="fp4_e2m1")
    with pytest.raises(ValueError, match="fp4_e2m1"):
        ToyModel(geometries)
