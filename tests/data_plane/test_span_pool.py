"""An engine's memory of several allocations (SGLang's K and V host buffers) as one pool in
its own layout, for the copies the engine makes itself: memory.span_buffer, the EngineLayout
bases it gives (V may lie below K), and client.engine_copy.local_pool over it."""

from __future__ import annotations

import pytest
import torch

from hicache.client.engine_copy import local_pool
from hicache.geometry import KVGeometry
from hicache.memory import SpanBuffer, local_buffer, span_buffer
from hicache.pools import HostKVPool
from hicache.pools.layouts import EngineLayout
from hicache.transfer import TransferEngine

# MiMo-like: K 192, V 128 (V's own dim everywhere)
G = KVGeometry(layer_num=3, head_num=2, head_dim=192, v_head_dim=128, page_size=4, dtype="bfloat16")
PAGES = 5


def sglang_buffers(v_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K [slots, L, H, 192] and V [slots, L, H, 128] (SGLang's page_first, K != V) in one
    backing tensor with a gap between them, V below K when v_first; and the backing."""
    k_n, v_n = (
        PAGES * G.page_size * G.layer_num * G.head_num * 192,
        PAGES * G.page_size * G.layer_num * G.head_num * 128,
    )
    backing = torch.randn(k_n + v_n + 1000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    k_at, v_at = (v_n + 1000, 0) if v_first else (0, k_n + 1000)
    k = backing[k_at : k_at + k_n].view(PAGES * G.page_size, G.layer_num, G.head_num, 192)
    v = backing[v_at : v_at + v_n].view(PAGES * G.page_size, G.layer_num, G.head_num, 128)
    return k, v, backing


@pytest.mark.parametrize("v_first", [False, True], ids=["k_below_v", "v_below_k"])
def test_a_span_pool_copies_each_row_of_k_and_v_and_nothing_between(v_first: bool) -> None:
    k, v, backing = sglang_buffers(v_first)
    span = span_buffer([k, v])
    assert isinstance(span, SpanBuffer) and span.nbytes == backing.nbytes  # from the lower one to the higher's end
    offsets = [at for at, _ in span.segments]
    assert (offsets[1] < offsets[0]) == v_first and [n for _, n in span.segments] == [k.nbytes, v.nbytes]
    pool = local_pool(G, PAGES, span, "sglang_page_first")
    assert isinstance(pool.layout, EngineLayout) and pool.layout.bases == tuple(offsets)
    pool.check_integrity()
    host = HostKVPool(G, 4, "page_first_direct", memory=local_buffer(G.pool_bytes(4)))
    before = backing.clone()
    with TransferEngine(pool, host) as engine:
        engine.offload([3, 1], [0, 1])
        assert torch.equal(backing, before)  # the source is unchanged
        for hp, p in ((0, 3), (1, 1)):
            for layer in range(G.layer_num):
                for b, side in enumerate((k, v)):
                    want = side[p * G.page_size : (p + 1) * G.page_size, layer].contiguous().view(torch.uint8)
                    assert torch.equal(host.chunks(b, hp, layer)[0, 0], want.reshape(G.page_size, -1))
        engine.reload([0], [4])
    expected = before.clone()  # page 4 of K and of V took page 3's rows; nothing else changed, the gap neither
    for side in (k, v):
        at = (side.data_ptr() - backing.data_ptr()) // backing.element_size()
        mine = expected[at : at + side.numel()].view(side.shape)
        mine[4 * G.page_size : 5 * G.page_size] = mine[3 * G.page_size : 4 * G.page_size]
    assert torch.equal(backing.view(torch.int16), expected.view(torch.int16))
    span.close()


def test_bad_spans_and_segments_are_refused_naming_them() -> None:
    k, v, backing = sglang_buffers(False)
    with pytest.raises(ValueError, match="at least one segment"):
        span_buffer([])
    with pytest.raises(ValueError, match=r"segment 1 must be a non-empty contiguous CPU tensor, got cpu"):
        span_buffer([k, v.transpose(0, 1)])
    with pytest.raises(ValueError, match="segment 1 must be .* got list"):
        span_buffer([k, [1, 2]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="segments 0 and 1 overlap"):
        span_buffer([backing[:100], backing[50:200]])
    # one segment per buffer, or one for all; each buffer's region within its own segment
    with pytest.raises(ValueError, match=r"3 memory segments for the buffers \['k', 'v'\]"):
        local_pool(G, PAGES, span_buffer([k, v, torch.zeros(10)]), "sglang_page_first")
    with pytest.raises(ValueError, match="memory segment 0 holds .* needs"):
        local_pool(G, PAGES, span_buffer([k[:-1], v]), "sglang_page_first")  # K one slot short
    with pytest.raises(ValueError, match="takes one allocation, got 2 segments"):
        local_pool(G, PAGES, span_buffer([k, v]), "")
    with pytest.raises(ValueError, match="do not fit at offsets"):
        EngineLayout(G, PAGES, "sglang_page_first", bases=(0, 100))  # V would start inside K


def test_regions_in_either_order_must_not_overlap() -> None:
    k_bytes = PAGES * G.page_size * G.layer_num * G.buffers[0].row_bytes
    v_bytes = PAGES * G.page_size * G.layer_num * G.buffers[1].row_bytes
    below = EngineLayout(G, PAGES, "sglang_page_first", bases=(v_bytes, 0))
    assert below.nbytes == v_bytes + k_bytes and below.regions() == [(v_bytes, v_bytes + k_bytes), (0, v_bytes)]
    with pytest.raises(ValueError, match="do not fit"):
        EngineLayout(G, PAGES, "sglang_page_first", bases=(v_bytes - 1, 0))
    with pytest.raises(ValueError, match="needs .* bytes, the memory holds"):
        EngineLayout(G, PAGES, "sglang_page_first", bases=(v_bytes, 0), extent=v_bytes + k_bytes - 1)
