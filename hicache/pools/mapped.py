"""An engine's KV memory in the engine's own layout (SGLang's host pools, vLLM's blocks), as the sidecar maps
it to copy straight from and to the engine's pages."""

from __future__ import annotations

import torch

from hicache.geometry import KVGeometry
from hicache.memory import SharedBuffer
from hicache.pools.device import DeviceKVPool
from hicache.pools.flat import FlatPool
from hicache.pools.layouts import Layout


class MappedKVPool(DeviceKVPool):
    """A device pool whose pages are where the engine keeps them: copies address it through
    its EngineLayout's or BlockLayout's strides. It has no per-layer tensor views (layer_buffers raises):
    the engine owns the tensors. CPU memory, or CUDA memory opened by IPC (BlockLayout)."""

    def __init__(self, geometry: KVGeometry, layout: Layout, memory: SharedBuffer):
        FlatPool.__init__(self, geometry, layout, memory)
        self.device = str(self.flat.device) if self.flat.is_cuda else "cpu"
        self._views = []

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        raise ValueError(f"a pool in the engine's layout {self.layout.name!r} has no per-layer views")

    def check_integrity(self) -> None:
        FlatPool.check_integrity(self)
