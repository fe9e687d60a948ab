"""A tiny causal transformer whose KV cache lives in DeviceKVPools, one pool per KV group.

Each model layer belongs to one group (its pool-local layer is geometry.local_layer(id)).
It attends with the group's real KV geometry: MiMo-V2-Flash full layers cache K 192 /
V 128 for 4 heads, its sliding-window layers 8 heads and attend to the last `window`
tokens; MLA caches one latent row (the value is its first kv_lora_rank columns).
The hidden state is small, so the model is cheap; only the KV cache is full size.

Prefill runs in chunks aligned to pages (chunk i holds tokens [i * page, (i+1) * page)),
so the K/V of a full page and the attention outputs of every token do not depend on
which earlier pages came from a cache: a cached prefix plus a computed suffix gives
the same bits as computing everything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.geometry import KVGeometry
from hicache.pools import DeviceKVPool

COMPUTE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True)
class Layer:
    """One model layer: its id, KV group, pool-local index and sliding window (None: full)."""

    layer_id: int
    group: str
    local: int
    window: int | None


@dataclass
class _Weights:
    wq: torch.Tensor  # [hidden, heads * k_dim]
    wk: torch.Tensor  # [hidden, heads * k_dim]
    wv: torch.Tensor  # [hidden, heads * v_dim] (unused for MLA)
    wo: torch.Tensor  # [heads * v_dim, hidden]


class ToyModel:
    """Deterministic weights from `seed`. Raises ValueError for a KV dtype it cannot compute in
    (fp4), for groups whose page sizes differ, or a bad window."""

    def __init__(
        self,
        geometries: dict[str, KVGeometry],
        *,
        window: int | None = None,
        hidden: int = 64,
        vocab: int = 4096,
        seed: int = 0,
    ):
        if not geometries or "full" not in geometries:
            raise ValueError(f"geometries must include the 'full' group, got {sorted(geometries)}")
        pages = {g.page_size for g in geometries.values()}
        if len(pages) != 1:
            raise ValueError(f"every group must have the same page_size, got {pages}")
        for name, g in geometries.items():
            if g.dtype not in COMPUTE_DTYPES:
                raise ValueError(f"the demo model computes in {COMPUTE_DTYPES}; group {name!r} has dtype {g.dtype!r}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self.geometries = geometries
        self.page_size = pages.pop()
        self.hidden, self.vocab = hidden, vocab
        layers = [
            Layer(lid, name, g.local_layer(lid), window if name == "swa" else None)
            for name, g in geometries.items()
            for lid in g.layer_ids or ()
        ]
        self.layers = sorted(layers, key=lambda layer: layer.layer_id)
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(vocab, hidden, generator=gen)
        self.weights = [self._init(geometries[layer.group], gen) for layer in self.layers]

    def _init(self, g: KVGeometry, gen: torch.Generator) -> _Weights:
        heads, k_dim, v_dim = self.dims(g)
        h = self.hidden

        def w(n_in: int, n_out: int) -> torch.Tensor:
            return torch.randn(n_in, n_out, generator=gen) / n_in**0.5

        return _Weights(w(h, heads * k_dim), w(h, heads * k_dim), w(h, heads * v_dim), w(heads * v_dim, h))

    @staticmethod
    def dims(g: KVGeometry) -> tuple[int, int, int]:
        """(heads, K width, V width) as attention sees them (MLA: V = the latent's first kv_lora_rank)."""
        assert g.head_dim is not None and g.v_head_dim is not None
        if g.is_mla:
            return 1, g.head_dim, g.kv_lora_rank
        return g.head_num, g.head_dim, g.v_head_dim

    # ---- forward ---------------------------------------------------------------------------
    def prefill(
        self,
        pools: dict[str, DeviceKVPool],
        pages: list[int],
        tokens: torch.Tensor,
        start: int,
        before_layer: Callable[[Layer], None] | None = None,
    ) -> list[torch.Tensor]:
        """Compute tokens[start:] given the K/V of tokens[:start] already in `pools`.

        pages[i] is the device page (the same index in every group's pool) of tokens
        [i * page_size, (i+1) * page_size); start must be a multiple of page_size.
        Writes the K/V of the computed tokens into the pools. before_layer(layer) is
        called before a layer first reads the cache (to wait for a layer-wise reload).
        Returns each layer's attention output, in model order. Shape: [tokens, heads, v_width].
        """
        ps = self.page_size
        n = int(tokens.numel())
        if start % ps or not 0 <= start <= n or len(pages) * ps < n:
            raise ValueError(f"start {start} must be a page multiple <= {n} tokens, with {len(pages)} pages of {ps}")
        slots = (torch.tensor(pages, dtype=torch.long)[:, None] * ps + torch.arange(ps)).flatten()[:n]
        outputs: list[list[torch.Tensor]] = [[] for _ in self.layers]
        waited: set[int] = set()
        for lo in range(start, n, ps):
            hi = min(lo + ps, n)
            pos = torch.arange(lo, hi, dtype=torch.float32)
            freqs = torch.exp(torch.arange(0, self.hidden, 2, dtype=torch.float32) * (-9.0 / self.hidden))
            angle = pos[:, None] * freqs
            h = self.embed[tokens[lo:hi] % self.vocab] + torch.cat([angle.sin(), angle.cos()], dim=1)
            for i, (layer, w) in enumerate(zip(self.layers, self.weights, strict=True)):
                if before_layer is not None and i not in waited:
                    before_layer(layer)
                    waited.add(i)
                out = self._attend(pools[layer.group], layer, w, h, slots, lo, hi)
                outputs[i].append(out)
                h = h + out.flatten(1) @ w.wo
        return [torch.cat(o) if o else torch.empty(0) for o in outputs]

    def _attend(
        self,
        pool: DeviceKVPool,
        layer: Layer,
        w: _Weights,
        h: torch.Tensor,
        slots: torch.Tensor,
        lo: int,
        hi: int,
    ) -> torch.Tensor:
        g = pool.geometry
        heads, k_dim, v_dim = self.dims(g)
        x = torch.nn.functional.layer_norm(h, (self.hidden,))
        q = (x @ w.wq).view(-1, heads, k_dim)
        k_buf = pool.k_buffer(layer.local)
        k_buf[slots[lo:hi]] = _store(x @ w.wk, k_buf.dtype, g.dtype).view(-1, *k_buf.shape[1:])
        if not g.is_mla:
            v_buf = pool.v_buffer(layer.local)
            v_buf[slots[lo:hi]] = _store(x @ w.wv, v_buf.dtype, g.dtype).view(-1, *v_buf.shape[1:])
        first = 0 if layer.window is None else max(0, lo - layer.window + 1)
        keys = slots[first:hi]
        k = _load(k_buf[keys], g.dtype)
        v = k[..., :v_dim] if g.is_mla else _load(pool.v_buffer(layer.local)[keys], g.dtype)
        scores = torch.einsum("qhd,khd->hqk", q, k) / k_dim**0.5
        qpos = torch.arange(lo, hi)[:, None]
        kpos = torch.arange(first, hi)[None, :]
        allowed = kpos <= qpos
        if layer.window is not None:
            allowed &= kpos > qpos - layer.window
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _store(x: torch.Tensor, storage: torch.dtype, dtype: str) -> torch.Tensor:
    """Cast float32 values to the cache's storage dtype (fp8 as its uint8 bits)."""
    if dtype.startswith("float8"):
        return x.to(getattr(torch, dtype)).view(torch.uint8)
    return x.to(storage)


def _load(x: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype.startswith("float8"):
        return x.view(getattr(torch, dtype)).float()
    return x.float()
