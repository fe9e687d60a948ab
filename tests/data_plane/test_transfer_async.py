"""Asynchronous transfers: per-layer completion, the single-writer rule, errors from the worker."""

import threading

import pytest
import torch
from conftest import load_config
from helpers import fill_random, same_page

from hicache import DeviceKVPool, HostKVPool, KVGeometry, TransferEngine
from hicache.pools import LAYOUTS
from hicache.transfer.engine import Pool
from hicache.transfer.plan import TransferPlan

GATE_TIMEOUT = 30  # seconds; only reached if the code under test is broken


def small_geometry(layers: int = 4) -> KVGeometry:
    return KVGeometry(layer_num=layers, head_num=2, head_dim=24, v_head_dim=16, page_size=4)


def gate_layers(engine: TransferEngine, hold_from: int) -> threading.Event:
    """Make the engine's transfer thread stop before copying layer `hold_from` until released
    (the torch backend's layer-by-layer path: the native one copies all layers in one C call)."""
    assert engine.backend == "torch", "gate a torch-backend engine"
    release = threading.Event()
    copy = engine._copy_layers

    def gated(src: Pool, dst: Pool, plan: TransferPlan, layers: tuple[int, ...] | None) -> None:
        if layers is not None and layers[0] >= hold_from:
            assert release.wait(GATE_TIMEOUT), "test gate never released"
        copy(src, dst, plan, layers)

    engine._copy_layers = gated  # type: ignore[method-assign]
    return release


@pytest.mark.parametrize("layout", LAYOUTS)
def test_async_roundtrip_is_bit_exact(layout):
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=4)
    src = DeviceKVPool(g, 6)
    fill_random(src, 1)
    src_before = src.flat.clone()
    host = HostKVPool(g, 5, layout)
    with TransferEngine(src, host) as engine:
        handle = engine.offload_async([4, 1, 2], [0, 3, 2])
        assert handle.wait() == 3 * g.page_bytes and handle.done()
    assert torch.equal(src.flat, src_before)
    dst = DeviceKVPool(g, 6)
    fill_random(dst, 3)
    dst_before = dst.flat.clone()
    with TransferEngine(dst, host) as engine:
        handle = engine.reload_async([0, 3, 2], [5, 0, 3])
        for layer in range(g.layer_num):
            handle.wait_layer(layer)
        assert handle.wait() == 3 * g.page_bytes
    for a, b in [(4, 5), (1, 0), (2, 3)]:
        assert same_page(src, a, dst, b)
    keep = DeviceKVPool(g, 6)
    keep.flat.copy_(dst_before)
    for p in (1, 2, 4):
        assert same_page(dst, p, keep, p)


def _layer_forward(pool: DeviceKVPool, layer: int, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One toy attention layer over the cached K/V of `slots`; its output feeds the next layer."""
    k = pool.k_buffer(layer)[slots].float()  # [tokens, heads, head_dim]
    v = pool.v_buffer(layer)[slots].float()  # [tokens, heads, v_head_dim]
    q = x[:, : k.shape[-1]]
    scores = torch.einsum("hd,thd->ht", q, k) / k.shape[-1] ** 0.5
    out = torch.einsum("ht,thd->hd", scores.softmax(-1), v)  # [heads, v_head_dim]
    return torch.cat([out, out], dim=-1)[:, : x.shape[-1]].contiguous() + x


def test_layerwise_forward_overlaps_the_reload():
    g = small_geometry(layers=5)
    dev = DeviceKVPool(g, 6)
    torch.manual_seed(0)
    for layer in range(g.layer_num):
        dev.k_buffer(layer).copy_(torch.randn(24, 2, 24))
        dev.v_buffer(layer).copy_(torch.randn(24, 2, 16))
    seq = [4, 1, 2]
    slots = torch.cat([torch.arange(p * 4, (p + 1) * 4) for p in seq])
    x0 = torch.randn(2, 24)
    want = x0
    for layer in range(g.layer_num):
        want = _layer_forward(dev, layer, slots, want)
    host = HostKVPool(g, 4, "page_first")
    engine = TransferEngine(dev, host, "torch")
    engine.offload(seq, [3, 0, 2])
    dev.flat.zero_()
    release = gate_layers(engine, hold_from=1)
    handle = engine.reload_async([3, 0, 2], seq)
    x = x0
    handle.wait_layer(0)
    # layer 0 is usable while layer 1 cannot have started: the reload is still in flight
    assert handle.layers_ready == 1 and not handle.done()  # type: ignore[attr-defined]
    x = _layer_forward(dev, 0, slots, x)
    release.set()
    for layer in range(1, g.layer_num):
        handle.wait_layer(layer)
        assert handle.layers_ready >= layer + 1  # type: ignore[attr-defined]
        x = _layer_forward(dev, layer, slots, x)
    handle.wait()
    assert torch.equal(x, want)
    engine.close()


def test_overlapping_destinations_are_rejected_and_nothing_changes():
    g = small_geometry()
    dev, host = DeviceKVPool(g, 6), HostKVPool(g, 6)
    fill_random(dev, 1)
    fill_random(host, 2)
    engine = TransferEngine(dev, host, "torch")
    release = gate_layers(engine, hold_from=1)
    first = engine.reload_async([0, 1], [1, 2])
    first.wait_layer(0)
    dev_mid, host_mid = dev.flat.clone(), host.flat.clone()
    with pytest.raises(ValueError, match=r"device_pages \[2\] are the destination of an unfinished transfer"):
        engine.reload_async([3, 4], [2, 3])
    with pytest.raises(ValueError, match=r"device_pages \[1, 2\]"):
        engine.reload([3, 4], [2, 1])
    assert torch.equal(dev.flat, dev_mid) and torch.equal(host.flat, host_mid)
    # other device pages, and host pages (a different pool), are free to write
    engine.reload([5], [4], layers=[0])
    engine.offload([0], [2])
    release.set()
    first.wait()
    second = engine.reload_async([3, 4], [2, 3])  # the first one finished: accepted now
    second.wait()
    assert same_page(host, 3, dev, 2) and same_page(host, 4, dev, 3)
    assert engine._writers.active() == []
    engine.close()


def test_offload_async_guards_host_pages():
    g = small_geometry()
    dev, host = DeviceKVPool(g, 4), HostKVPool(g, 4)
    engine = TransferEngine(dev, host, "torch")
    release = gate_layers(engine, hold_from=1)
    handle = engine.offload_async([0, 1], [3, 2])
    with pytest.raises(ValueError, match=r"host_pages \[3\]"):
        engine.offload([2], [3])
    release.set()
    assert handle.wait() == 2 * g.page_bytes
    engine.close()


def test_worker_errors_surface_from_wait_and_release_the_pages():
    g = small_geometry()
    dev, host = DeviceKVPool(g, 4), HostKVPool(g, 4)
    engine = TransferEngine(dev, host, "torch")
    copy = engine._copy_layers

    def failing(src, dst, plan, layers):
        if layers == (2,):
            raise RuntimeError("copy thread broke on layer 2")
        copy(src, dst, plan, layers)

    engine._copy_layers = failing  # type: ignore[method-assign]
    handle = engine.reload_async([0], [1])
    handle.wait_layer(1)  # layers before the failure are published
    with pytest.raises(RuntimeError, match="broke on layer 2"):
        handle.wait_layer(3)
    with pytest.raises(RuntimeError, match="broke on layer 2"):
        handle.wait()
    assert handle.done()
    engine._copy_layers = copy  # type: ignore[method-assign]
    engine.reload_async([0], [1]).wait()  # the failed transfer no longer holds page 1
    engine.close()


def test_handle_rejects_a_layer_it_does_not_carry():
    g = small_geometry()
    engine = TransferEngine(DeviceKVPool(g, 2), HostKVPool(g, 2))
    handle = engine.reload_async([0], [1], layers=[1, 3])
    with pytest.raises(ValueError, match=r"layer 2 is not part of this transfer \(layers \[1, 3\]\)"):
        handle.wait_layer(2)
    handle.wait_layer(3)
    assert handle.wait() == g.page_bytes_for(2)
    engine.close()


def test_async_validation_errors_start_nothing():
    g = small_geometry()
    engine = TransferEngine(DeviceKVPool(g, 2), HostKVPool(g, 2))
    with pytest.raises(ValueError, match="device_pages has page 7 out of range"):
        engine.reload_async([0], [7])
    with pytest.raises(ValueError, match="host_pages has duplicate page 1"):
        engine.offload_async([0, 1], [1, 1])
    assert engine._writers.active() == []
    assert engine._driver is None
    engine.close()


def test_empty_async_transfer_finishes():
    g = small_geometry()
    engine = TransferEngine(DeviceKVPool(g, 2), HostKVPool(g, 2))
    assert engine.reload_async([], []).wait() == 0
    engine.close()


class CountedEvent:
    """Stands in for a CUDA event (query / synchronize, which is all the handle calls) that
    completes at its `ready_after`-th query (None: never): the handle's timeout logic runs
    on CPU. Events of one stream complete in order, so a later one's completion implies it."""

    def __init__(self, ready_after: int | None):
        self.ready_after, self.queries = ready_after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.ready_after is not None and self.queries >= self.ready_after

    def synchronize(self) -> None:
        assert self.ready_after is not None, "synchronize on an event that never completes would hang"


def test_a_cuda_handles_wait_with_a_timeout_returns_when_the_copy_ends_not_at_the_timeout(monkeypatch):
    from hicache.transfer import handles

    slept: list[float] = []
    monkeypatch.setattr(handles.time, "sleep", slept.append)  # no real sleeping: only what was asked
    events = [CountedEvent(1), CountedEvent(5)]
    handle = handles.CudaTransferHandle((0, 1), 10, "device", frozenset({1}), events)
    assert handle.wait(timeout=600) == 10  # polled until the last layer's event completed
    assert events[1].queries == 5 and len(slept) == 4 and max(slept) <= 1e-3
    handle.wait_layer_host(1, timeout=600)


def test_a_cuda_handles_wait_raises_timeout_error_when_the_copy_does_not_end():
    from hicache.transfer import handles

    handle = handles.CudaTransferHandle((0, 3), 10, "device", frozenset({1}), [CountedEvent(1), CountedEvent(None)])
    with pytest.raises(TimeoutError, match="transfer not finished after 0.01 s"):
        handle.wait(timeout=0.01)
    with pytest.raises(TimeoutError, match="layer 3 not copied after 0.01 s"):
        handle.wait_layer_host(3, timeout=0.01)
    handle.wait_layer_host(0, timeout=0.01)  # that layer's event is complete
