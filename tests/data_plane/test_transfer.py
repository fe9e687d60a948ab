import numpy as np
import pytest
import torch
from conftest import CONFIG_NAMES, CPU_BACKENDS, load_config
from helpers import fill_random, same_page
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache import DeviceKVPool, HostKVPool, KVGeometry, TransferEngine
from hicache.pools import LAYOUTS

DTYPES = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "fp4_e2m1"]
GROUPS = {"mimo_v2_flash": ["full", "swa"]}


def _cases():
    for name in CONFIG_NAMES:
        for group in GROUPS.get(name, ["full"]):
            yield name, group


def roundtrip(g: KVGeometry, layout: str, backend: str = "torch", dev_pages: int = 6, host_pages: int = 5) -> None:
    """device -> host -> fresh device into other pages; checks source, mapped and unmapped pages."""
    src = DeviceKVPool(g, dev_pages)
    fill_random(src, seed=1)
    src_before = src.flat.clone()
    host = HostKVPool(g, host_pages, layout)
    fill_random(host, seed=2)
    host_before = host.flat.clone()
    offload_dev, offload_host = [4, 1, 2], [0, 3, 2]
    TransferEngine(src, host, backend).offload(offload_dev, offload_host)  # type: ignore[arg-type]
    assert torch.equal(src.flat, src_before)  # source unchanged
    for d, h in zip(offload_dev, offload_host, strict=True):
        assert same_page(src, d, host, h)
    untouched = HostKVPool(g, host_pages, "page_first_direct")
    untouched.flat.copy_(host_before)
    fresh = HostKVPool(g, host_pages, layout)
    fresh.flat.copy_(host_before)
    assert same_page(host, 1, fresh, 1) and same_page(host, 4, fresh, 4)

    dst = DeviceKVPool(g, dev_pages)
    fill_random(dst, seed=3)
    dst_before = dst.flat.clone()
    host_after = host.flat.clone()
    reload_dev = [0, 5, 3]
    TransferEngine(dst, host, backend).reload(offload_host, reload_dev)  # type: ignore[arg-type]
    assert torch.equal(host.flat, host_after)
    for d_src, d_dst in zip(offload_dev, reload_dev, strict=True):
        assert same_page(src, d_src, dst, d_dst)
    keep = DeviceKVPool(g, dev_pages)
    keep.flat.copy_(dst_before)
    for p in set(range(dev_pages)) - set(reload_dev):
        assert same_page(dst, p, keep, p)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,group", list(_cases()))
def test_roundtrip_fixture_configs(name, group, layout, backend):
    cfg = load_config(name)
    dtypes = ["bfloat16"] if name == "deepseek_v3" else DTYPES
    for dtype in dtypes:
        g = KVGeometry.from_hf_config(cfg, group=group, page_size=4, dtype=dtype)
        roundtrip(g, layout, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "fp4_e2m1"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_roundtrip_mla(layout, dtype, backend):
    g = KVGeometry.from_hf_config(load_config("deepseek_v3"), page_size=2, dtype=dtype)
    roundtrip(g, layout, backend)


def test_regression_v_head_dim_differs_from_head_dim():
    """The SGLang bug: V sized or strided with head_dim. V must survive the round trip exactly."""
    g = KVGeometry(layer_num=3, head_num=2, head_dim=192, v_head_dim=128, page_size=8)
    assert g.v_row_bytes == 2 * 128 * 2 and g.k_row_bytes == 2 * 192 * 2
    for layout in LAYOUTS:
        host = HostKVPool(g, 4, layout)
        assert host.nbytes == 4 * 8 * 3 * (2 * 192 + 2 * 128) * 2  # no V buffer sized with head_dim
        dev = DeviceKVPool(g, 4)
        for layer in range(3):
            dev.v_buffer(layer).copy_(torch.randn(32, 2, 128).to(torch.bfloat16))
            dev.k_buffer(layer).copy_(torch.randn(32, 2, 192).to(torch.bfloat16))
        want_v = [dev.v_buffer(layer)[dev.page_slots(2)].clone() for layer in range(3)]
        want_k = [dev.k_buffer(layer)[dev.page_slots(2)].clone() for layer in range(3)]
        engine = TransferEngine(dev, host)
        engine.offload([2], [1])
        dev.flat.zero_()
        engine.reload([1], [0])
        for layer in range(3):
            assert torch.equal(dev.v_buffer(layer)[dev.page_slots(0)], want_v[layer])
            assert torch.equal(dev.k_buffer(layer)[dev.page_slots(0)], want_k[layer])


def _attention(pool: DeviceKVPool, layer: int, slots: slice, q: torch.Tensor) -> torch.Tensor:
    k = pool.k_buffer(layer)[slots].float()  # [tokens, heads, 192]
    v = pool.v_buffer(layer)[slots].float()  # [tokens, heads, 128]
    scores = torch.einsum("hd,thd->ht", q, k) / k.shape[-1] ** 0.5
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v)  # [heads, 128]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_identical_after_offload_clear_reload(layout):
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=16)
    dev = DeviceKVPool(g, 4)
    torch.manual_seed(0)
    for layer in range(g.layer_num):
        dev.k_buffer(layer).copy_(torch.randn(64, 4, 192))
        dev.v_buffer(layer).copy_(torch.randn(64, 4, 128))
    q = torch.randn(4, 192)
    seq = [1, 3]  # a two-page sequence
    slots = torch.cat([torch.arange(p * 16, (p + 1) * 16) for p in seq])
    before = [_attention(dev, layer, slots, q) for layer in range(g.layer_num)]
    host = HostKVPool(g, 3, layout)
    engine = TransferEngine(dev, host)
    engine.offload(seq, [2, 0])
    dev.flat.zero_()
    engine.reload([2, 0], seq)
    after = [_attention(dev, layer, slots, q) for layer in range(g.layer_num)]
    assert before[0].shape == (4, 128)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_reload_selected_layers_only():
    g = KVGeometry(layer_num=4, head_num=1, head_dim=32, v_head_dim=16, page_size=4)
    dev = DeviceKVPool(g, 2)
    fill_random(dev)
    host = HostKVPool(g, 2)
    engine = TransferEngine(dev, host)
    engine.offload([0], [1])
    target = DeviceKVPool(g, 2)
    moved = TransferEngine(target, host).reload([1], [1], layers=[3, 1])
    assert moved == g.page_bytes_for(2)
    assert same_page(dev, 0, target, 1, layers=[1, 3])
    assert int(target.k_buffer(0).count_nonzero()) == 0 and int(target.k_buffer(2).count_nonzero()) == 0


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    attention=st.sampled_from(["mha", "mla"]),
    layer_num=st.integers(1, 4),
    head_num=st.integers(1, 4),
    dims=st.tuples(st.integers(1, 8), st.integers(1, 8)),
    page_size=st.integers(1, 5),
    dtype=st.sampled_from(["bfloat16", "float16", "float32", "float8_e5m2", "fp4_e2m1"]),
    layout=st.sampled_from(LAYOUTS),
    backend=st.sampled_from(CPU_BACKENDS),
)
def test_roundtrip_random_geometry(data, attention, layer_num, head_num, dims, page_size, dtype, layout, backend):
    mult = 16  # keeps fp4 legal
    if attention == "mla":
        g = KVGeometry(
            attention="mla",
            layer_num=layer_num,
            head_num=1,
            kv_lora_rank=dims[0] * mult,
            qk_rope_head_dim=dims[1] * mult,
            page_size=page_size,
            dtype=dtype,
        )
    else:
        g = KVGeometry(
            layer_num=layer_num,
            head_num=head_num,
            head_dim=dims[0] * mult,
            v_head_dim=dims[1] * mult,
            page_size=page_size,
            dtype=dtype,
        )
    n_dev, n_host = 7, 6
    n = data.draw(st.integers(0, 6))
    dev_pages = data.draw(st.permutations(range(n_dev)))[:n]
    host_pages = data.draw(st.permutations(range(n_host)))[:n]
    dev = DeviceKVPool(g, n_dev)
    fill_random(dev, seed=n)
    host = HostKVPool(g, n_host, layout)
    host_before = host.flat.clone()
    engine = TransferEngine(dev, host, backend)
    engine.offload(dev_pages, host_pages)
    for d, h in zip(dev_pages, host_pages, strict=True):
        assert same_page(dev, d, host, h)
    ref = HostKVPool(g, n_host, layout)
    ref.flat.copy_(host_before)
    for h in set(range(n_host)) - set(host_pages):
        assert same_page(host, h, ref, h)
    back = DeviceKVPool(g, n_dev)
    targets = data.draw(st.permutations(range(n_dev)))[:n]
    TransferEngine(back, host, backend).reload(host_pages, targets)
    for d, t in zip(dev_pages, targets, strict=True):
        assert same_page(dev, d, back, t)
    for t in set(range(n_dev)) - set(targets):
        assert int(back.chunks(0, t, 0, 1, g.layer_num).count_nonzero()) == 0
    dev.check_integrity()
    host.check_integrity()


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda e: e.offload([0, 9], [0, 1]), "device_pages has page 9 out of range \\[0, 4\\)"),
        (lambda e: e.offload([0, 1], [0, 3]), "host_pages has page 3 out of range \\[0, 3\\)"),
        (lambda e: e.offload([-1], [0]), "device_pages has page -1 out of range"),
        (lambda e: e.offload(np.array([4]), np.array([0])), "device_pages has page 4 out of range \\[0, 4\\)"),
        (lambda e: e.reload(np.array([0]), np.array([-2])), "device_pages has page -2 out of range"),
        (lambda e: e.offload([1, 1], [0, 2]), "device_pages has duplicate page 1"),
        (lambda e: e.offload([0, 1], [2, 2]), "host_pages has duplicate page 2"),
        (lambda e: e.offload([0, 1], [2]), "device_pages has 2 pages but host_pages has 1"),
        (lambda e: e.offload([[0]], [[1]]), "device_pages must be a 1-D list"),
        (lambda e: e.offload([0.5], [1]), "device_pages must hold integers, got dtype float64"),
        (lambda e: e.reload([0], [1], layers=[2]), "layer 2 out of range \\[0, 2\\)"),
        (lambda e: e.reload([0], [1], layers=[1, 1]), "layers has duplicates"),
        (lambda e: e.reload([0, 1], [1], layers=None), "host_pages has 2 pages but device_pages has 1"),
    ],
)
def test_transfer_errors_leave_pools_untouched(call, message):
    g = KVGeometry(layer_num=2, head_num=1, head_dim=16, v_head_dim=8, page_size=2)
    dev, host = DeviceKVPool(g, 4), HostKVPool(g, 3)
    fill_random(dev, 1)
    fill_random(host, 2)
    dev_before, host_before = dev.flat.clone(), host.flat.clone()
    with pytest.raises(ValueError, match=message):
        call(TransferEngine(dev, host))
    assert torch.equal(dev.flat, dev_before) and torch.equal(host.flat, host_before)


def test_engine_rejects_mismatched_geometries():
    a = KVGeometry(layer_num=2, head_num=1, head_dim=16, v_head_dim=8)
    b = KVGeometry(layer_num=2, head_num=1, head_dim=16, v_head_dim=16)
    with pytest.raises(ValueError, match="fields differ: \\['v_head_dim'\\]"):
        TransferEngine(DeviceKVPool(a, 1), HostKVPool(b, 1))
    with pytest.raises(ValueError, match="backend must be"):
        TransferEngine(DeviceKVPool(a, 1), HostKVPool(a, 1), backend="cuda")  # type: ignore[arg-type]


def test_empty_transfer_is_a_noop():
    g = KVGeometry(layer_num=1, head_num=1, head_dim=16, v_head_dim=8)
    assert TransferEngine(DeviceKVPool(g, 1), HostKVPool(g, 1)).offload([], []) == 0
    empty = np.zeros(0, dtype=np.int64)
    assert TransferEngine(DeviceKVPool(g, 1), HostKVPool(g, 1)).offload(empty, empty) == 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_page_lists_may_be_strided_or_other_integer_arrays(backend):
    """int64 arrays with a stride (a slice), int32 and big-endian ones copy the pages they name."""
    g = KVGeometry(layer_num=2, head_num=1, head_dim=16, v_head_dim=8, page_size=2)
    dev, host = DeviceKVPool(g, 8), HostKVPool(g, 8)
    fill_random(dev, 3)
    engine = TransferEngine(dev, host, backend)
    every_other = np.arange(8, dtype=np.int64)[::2]  # pages 0 2 4 6, not contiguous
    engine.offload(every_other, np.array([7, 5, 3, 1], dtype=">i8"))
    for d, h in ((0, 7), (2, 5), (4, 3), (6, 1)):
        assert same_page(dev, d, host, h)
    back = DeviceKVPool(g, 8)
    TransferEngine(back, host, backend).reload(np.array([7, 5], dtype=np.int32), np.arange(8)[1::4])  # into 1, 5
    assert same_page(dev, 0, back, 1) and same_page(dev, 2, back, 5)
