"""The engine's device KV pool: per-layer K/V (or MLA latent) buffers carved from one allocation."""

from __future__ import annotations

import torch

from hicache.geometry import KVGeometry
from hicache.memory import MemoryHandle, SharedBuffer, alloc_device, open_cuda_ipc, open_shm
from hicache.pools.flat import FlatPool
from hicache.pools.layouts import LayerFirst
from hicache.validate import is_int


class DeviceKVPool(FlatPool):
    """The KV cache an inference engine computes attention from.

    One allocation of num_pages * geometry.page_bytes, laid out layer_first, so that it
    can be shared whole: POSIX shared memory on "cpu", one cudaMalloc (CUDA IPC) on "cuda".
    Per layer it exposes, each indexed by token slot (num_pages * page_size slots):
      MHA: k [slots, head_num, head_dim], v [slots, head_num, v_head_dim]
      MLA: kv [slots, 1, kv_lora_rank + qk_rope_head_dim]
      fp4 adds k_scale/v_scale (kv_scale) [slots, head_num, dim // 16]; fp8/fp4 are uint8.

    Raises ValueError for num_pages < 1 or an unknown device.
    """

    def __init__(
        self, geometry: KVGeometry, num_pages: int, device: str = "cpu", *, memory: SharedBuffer | None = None
    ):
        layout = LayerFirst(geometry, num_pages)
        super().__init__(geometry, layout, memory if memory is not None else alloc_device(layout.nbytes, device))
        self.device = str(self.flat.device) if self.flat.is_cuda else "cpu"
        self._views = [self._layer_views(layer) for layer in range(geometry.layer_num)]

    @classmethod
    def attach(cls, geometry: KVGeometry, num_pages: int, handle: MemoryHandle, device: str = "cpu") -> DeviceKVPool:
        """Map a pool that another process allocated, from its `handle`."""
        nbytes = geometry.pool_bytes(num_pages)
        if handle.nbytes != nbytes:
            raise ValueError(f"memory handle holds {handle.nbytes} bytes, geometry x {num_pages} pages needs {nbytes}")
        if handle.kind == "shm":
            memory = open_shm(handle.name, nbytes)
        elif handle.kind == "cuda_ipc":
            memory = open_cuda_ipc(handle, device)
        else:
            raise ValueError(f"cannot attach memory of kind {handle.kind!r}")
        return cls(geometry, num_pages, device, memory=memory)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.geometry.page_size

    def _layer_views(self, layer: int) -> tuple[torch.Tensor, ...]:
        views = []
        for b, spec in enumerate(self.geometry.buffers):
            s = self.layout.strides[b]
            start = s.offset(0, layer)
            flat = self.flat[start : start + self.num_slots * spec.row_bytes]
            views.append(flat.view(getattr(torch, spec.storage_dtype)).view(self.num_slots, *spec.row_shape))
        return tuple(views)

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Every buffer of pool-local `layer`, in geometry.buffers order. Raises ValueError."""
        if not is_int(layer) or not 0 <= layer < self.geometry.layer_num:
            raise ValueError(f"layer {layer!r} out of range [0, {self.geometry.layer_num})")
        return self._views[layer]

    def buffer(self, layer: int, name: str) -> torch.Tensor:
        """The buffer called `name` ("k", "v", "kv", "k_scale", ...) of pool-local `layer`."""
        names = [b.name for b in self.geometry.buffers]
        if name not in names:
            raise ValueError(f"no buffer {name!r} in this geometry; it has {names}")
        return self.layer_buffers(layer)[names.index(name)]

    def k_buffer(self, layer: int) -> torch.Tensor:
        """K of `layer` (the latent for MLA). Shape: [slots, head_num, head_dim]."""
        return self.layer_buffers(layer)[0]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """V of `layer`. Shape: [slots, head_num, v_head_dim]. Raises ValueError for MLA."""
        if self.geometry.is_mla:
            raise ValueError("an MLA pool has no V buffer; read the latent with k_buffer()")
        return self.layer_buffers(layer)[1]

    def page_slots(self, page: int) -> slice:
        """The token slots of `page`."""
        self._check_page(page)
        return slice(page * self.geometry.page_size, (page + 1) * self.geometry.page_size)

    def check_integrity(self) -> None:
        super().check_integrity()
        total = sum(v.numel() * v.element_size() for views in self._views for v in views)
        assert total == self.nbytes, (total, self.nbytes)
