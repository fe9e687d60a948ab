"""The KV geometry: the one place where a KV-cache shape or byte count is computed.

Every pool, layout, kernel launch, stored page and RPC handshake reads these
properties; none of them multiplies dimensions on its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from hicache.hf_config import geometry_kwargs, model_groups
from hicache.kv_dtypes import DTYPES as DTYPES  # the names callers read from here
from hicache.kv_dtypes import FP4_BLOCK, STORAGE, normalize_dtype
from hicache.validate import is_int

Attention = Literal["mha", "mla"]
Side = Literal["k", "v"]

MAX_PAGE_BYTES = 1 << 40  # a page larger than 1 TiB is a mistake, not a model
MAX_LAYERS = 1 << 16  # models have a few hundred; the layer ids are built per layer, so bound them first


@dataclass(frozen=True)
class BufferSpec:
    """One per-layer buffer of a KV pool, indexed by token slot.

    Shape of the buffer: [slots, *row_shape], stored as `storage_dtype`.
    """

    name: str  # "k", "v", "k_scale", "v_scale", "kv" (MLA latent), "kv_scale"
    side: Side
    row_shape: tuple[int, ...]
    storage_dtype: str  # torch dtype name: bfloat16, float16, float32 or uint8
    row_bytes: int


@dataclass(frozen=True, kw_only=True)
class KVGeometry:
    """The shape of one KV-cache group (a set of layers sharing one layout).

    MHA caches per layer a K row [head_num, head_dim] and a V row
    [head_num, v_head_dim] per token. MLA caches one latent row of width
    kv_lora_rank + qk_rope_head_dim (head_num 1); for MLA, head_dim is that width
    and v_head_dim is 0. fp8 is stored as uint8; fp4 packs two values per byte
    and adds one uint8 scale per 16 elements in separate scale buffers.

    Raises ValueError, naming the field and value, for any inconsistency.
    """

    attention: Attention = "mha"
    layer_num: int
    head_num: int
    head_dim: int | None = None
    v_head_dim: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    page_size: int = 64
    dtype: str = "bfloat16"
    layer_ids: tuple[int, ...] | None = None
    buffers: tuple[BufferSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"KVGeometry.attention must be 'mha' or 'mla', got {self.attention!r}")
        set_(self, "dtype", normalize_dtype(self.dtype))
        for name in ("layer_num", "head_num", "page_size"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.layer_num > MAX_LAYERS:
            raise ValueError(f"KVGeometry.layer_num must be <= {MAX_LAYERS}, got {self.layer_num}")
        for name in ("kv_lora_rank", "qk_rope_head_dim"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.attention == "mla":
            self._fill_mla()
        else:
            self._check_mha()
        ids = tuple(range(self.layer_num)) if self.layer_ids is None else tuple(self.layer_ids)
        if len(ids) != self.layer_num:
            raise ValueError(f"KVGeometry.layer_ids has {len(ids)} entries but layer_num is {self.layer_num}")
        for i in ids:
            _check_int("layer_ids entry", i, minimum=0)
        if len(set(ids)) != len(ids):
            raise ValueError(f"KVGeometry.layer_ids has duplicates: {ids}")
        set_(self, "layer_ids", ids)
        set_(self, "buffers", self._make_buffers())
        if self.page_bytes > MAX_PAGE_BYTES:
            raise ValueError(f"KVGeometry.page_bytes {self.page_bytes} exceeds the limit {MAX_PAGE_BYTES}")

    def _fill_mla(self) -> None:
        if self.kv_lora_rank < 1:
            raise ValueError(f"KVGeometry.kv_lora_rank must be >= 1 for MLA, got {self.kv_lora_rank}")
        if self.head_num != 1:
            raise ValueError(f"KVGeometry.head_num must be 1 for MLA, got {self.head_num}")
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if self.head_dim not in (None, width):
            raise ValueError(
                f"KVGeometry.head_dim for MLA is the latent width kv_lora_rank + "
                f"qk_rope_head_dim = {width}, got {self.head_dim}"
            )
        if self.v_head_dim not in (None, 0):
            raise ValueError(f"KVGeometry.v_head_dim must be 0 for MLA (no V cache), got {self.v_head_dim}")
        object.__setattr__(self, "head_dim", width)
        object.__setattr__(self, "v_head_dim", 0)
        self._check_fp4("kv_lora_rank + qk_rope_head_dim", width)

    def _check_mha(self) -> None:
        # v_head_dim never defaults to head_dim: that silent default is the bug class this ends.
        if self.head_dim is None or self.v_head_dim is None:
            raise ValueError(
                f"KVGeometry needs both head_dim and v_head_dim for MHA, got "
                f"head_dim={self.head_dim} v_head_dim={self.v_head_dim}"
            )
        _check_int("head_dim", self.head_dim, minimum=1)
        _check_int("v_head_dim", self.v_head_dim, minimum=1)
        if self.kv_lora_rank or self.qk_rope_head_dim:
            raise ValueError(
                f"KVGeometry.kv_lora_rank/qk_rope_head_dim must be 0 for MHA, got "
                f"{self.kv_lora_rank}/{self.qk_rope_head_dim}"
            )
        self._check_fp4("head_dim", self.head_dim)
        self._check_fp4("v_head_dim", self.v_head_dim)

    def _check_fp4(self, name: str, dim: int) -> None:
        if self.is_fp4 and dim % FP4_BLOCK:
            raise ValueError(f"KVGeometry.{name} must be divisible by {FP4_BLOCK} for fp4_e2m1, got {dim}")

    def _make_buffers(self) -> tuple[BufferSpec, ...]:
        assert self.head_dim is not None and self.v_head_dim is not None
        bits, storage = STORAGE[self.dtype]
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}[storage]
        sides: list[tuple[str, Side, int]] = (
            [("kv", "k", self.head_dim)]
            if self.attention == "mla"
            else [("k", "k", self.head_dim), ("v", "v", self.v_head_dim)]
        )
        specs = []
        for name, side, dim in sides:
            width = dim * bits // 8 // itemsize  # storage elements per head
            specs.append(BufferSpec(name, side, (self.head_num, width), storage, self.head_num * dim * bits // 8))
        if self.is_fp4:
            for name, side, dim in sides:
                width = dim // FP4_BLOCK
                specs.append(BufferSpec(f"{name}_scale", side, (self.head_num, width), "uint8", self.head_num * width))
        return tuple(specs)

    # ---- derived sizes (the byte counts are cached: read on every transfer) --------------
    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def is_fp4(self) -> bool:
        return self.dtype == "fp4_e2m1"

    @cached_property
    def k_row_bytes(self) -> int:
        """Bytes of K (or the MLA latent) per token per layer, scales included."""
        return sum(b.row_bytes for b in self.buffers if b.side == "k")

    @cached_property
    def v_row_bytes(self) -> int:
        """Bytes of V per token per layer, scales included; 0 for MLA."""
        return sum(b.row_bytes for b in self.buffers if b.side == "v")

    @cached_property
    def layer_row_bytes(self) -> int:
        """Bytes per token per layer, K + V."""
        return self.k_row_bytes + self.v_row_bytes

    @cached_property
    def token_bytes(self) -> int:
        """Bytes per token over all layers, K + V."""
        return self.layer_num * self.layer_row_bytes

    @cached_property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers: token_bytes * page_size."""
        return self.token_bytes * self.page_size

    def page_bytes_for(self, layers: int) -> int:
        """Bytes of one page restricted to `layers` layers (a layer-wise transfer)."""
        return layers * self.layer_row_bytes * self.page_size

    def row_offset(self, index: int) -> int:
        """Bytes before buffer `index` in one token's layer row (buffers in `buffers` order)."""
        return sum(b.row_bytes for b in self.buffers[:index])

    def chunk_offset(self, index: int) -> int:
        """Bytes before buffer `index` in one (page, layer) block of page_size rows per buffer."""
        return self.row_offset(index) * self.page_size

    def chunk_bytes(self, buffer: BufferSpec) -> int:
        """Bytes of one (page, layer) chunk of one buffer."""
        return buffer.row_bytes * self.page_size

    def pool_bytes(self, num_pages: int) -> int:
        """Bytes of a pool holding num_pages pages. Raises ValueError if num_pages < 1."""
        _check_int("num_pages", num_pages, minimum=1)
        return num_pages * self.page_bytes

    def local_layer(self, layer_id: int) -> int:
        """Pool-local index (0..layer_num-1) of the model layer `layer_id`. Raises KeyError."""
        assert self.layer_ids is not None
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise KeyError(f"model layer {layer_id} is not in this geometry's layer_ids {self.layer_ids}") from None

    def to_dict(self) -> dict[str, Any]:
        """The defining fields, JSON-friendly; KVGeometry(**d) rebuilds an equal geometry."""
        assert self.layer_ids is not None
        return {
            "attention": self.attention,
            "layer_num": self.layer_num,
            "head_num": self.head_num,
            "head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "page_size": self.page_size,
            "dtype": self.dtype,
            "layer_ids": list(self.layer_ids),
        }

    def diff(self, other: KVGeometry) -> list[str]:
        """Names of the fields whose values differ from `other`'s."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [k for k in mine if mine[k] != theirs[k]]

    @property
    def fingerprint(self) -> str:
        """A stable 16-hex-digit digest of the defining fields, for stored pages and handshakes."""
        text = ";".join(f"{k}={v}" for k, v in self.to_dict().items())
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_hf_config(
        cls,
        config: dict[str, Any],
        *,
        tp_size: int = 1,
        page_size: int = 64,
        dtype: str = "bfloat16",
        group: str = "full",
    ) -> KVGeometry:
        """Build the geometry of one group ("full" or "swa") from a Hugging Face config dict.

        See hicache.hf_config for the rules. Raises ValueError for an inconsistent config,
        a bad tp_size, or a group the model lacks.
        """
        return cls(**geometry_kwargs(config, tp_size=tp_size, page_size=page_size, dtype=dtype, group=group))


def model_geometries(config: dict[str, Any], *, tp_size: int, page_size: int, dtype: str) -> dict[str, KVGeometry]:
    """The geometry of every KV group the model has: "full", and "swa" for hybrid models.
    Raises ValueError as KVGeometry.from_hf_config does."""
    return {
        g: KVGeometry.from_hf_config(config, tp_size=tp_size, page_size=page_size, dtype=dtype, group=g)
        for g in model_groups(config)
    }


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if not is_int(value):
        raise ValueError(f"KVGeometry.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"KVGeometry.{name} must be >= {minimum}, got {value}")
