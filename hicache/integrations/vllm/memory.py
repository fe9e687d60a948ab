"""Where a vLLM KV-cache group's blocks are: the file behind vLLM's one KV allocation, and
the BlockLayout that addresses the group's layers in it.

vLLM places every layer of a KVCacheTensor in one backing allocation: layer l's block b at
offset + l * layer_stride + b * block_stride. CanonicalKVCaches hands the worker one
(num_blocks, page_bytes) int8 view per layer; the strides are read back from those views.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hicache.memory import MemoryHandle, SharedBuffer, shared_file_of, wrap_tensor
from hicache.pools.layouts import block_layout_name


@dataclass(frozen=True)
class GroupMemory:
    """One group's blocks: num_blocks blocks in the BlockLayout `layout`, in CPU memory behind
    `fd` (the caller sends it, and closes it at the end) of `nbytes`, or (fd -1) in vLLM's
    CUDA allocation exported as `cuda` on device `cuda_device`, or (fd -1) in memory the
    sidecar cannot map, `private`: the worker copies itself (copy path "engine")."""

    fd: int
    nbytes: int
    num_blocks: int
    layout: str
    cuda: MemoryHandle | None = None
    cuda_device: int = 0
    private: SharedBuffer | None = field(default=None, repr=False)

    def handle(self, fd_id: str) -> MemoryHandle:
        return self.cuda if self.cuda is not None else MemoryHandle("fd", self.nbytes, name=fd_id)


def group_memory(views: Sequence[torch.Tensor], group: int, packed_layer_bytes: int = 0) -> GroupMemory:
    """The memory of one group's per-layer views, in layer order; or, packed_layer_bytes > 0,
    of one view whose block holds every layer's page back to back, each of that many bytes
    (vLLM's block-outermost layouts). Raises ValueError for memory the sidecar cannot map
    (private CPU memory, CUDA memory outside one allocation), or layers that are not evenly
    spaced in one allocation."""
    first = views[0]
    num_blocks, block_stride = first.shape[0], first.stride(0)
    addrs = [v.data_ptr() for v in views]
    layer_stride = addrs[1] - addrs[0] if len(addrs) > 1 else packed_layer_bytes
    for i, v in enumerate(views):
        if v.dtype != torch.int8 or v.dim() != 2 or v.stride(1) != 1:
            raise ValueError(
                f"vLLM group {group} layer {i}: expected an int8 (num_blocks, page) view, got {v.dtype} {tuple(v.shape)}"
            )
        if v.shape[0] != num_blocks or v.stride(0) != block_stride or (i and addrs[i] != addrs[0] + i * layer_stride):
            raise ValueError(
                f"vLLM group {group}: layer {i} is not at the common strides (block {block_stride}, layer {layer_stride})"
            )
    if layer_stride < 0:
        raise ValueError(f"vLLM group {group}: layers lie in descending addresses")
    if first.is_cuda:
        return _cuda_memory(views, group, layer_stride, block_stride)
    try:
        head = shared_file_of(addrs[0])
    except ValueError:  # vLLM's CPU worker allocates its KV cache with torch.zeros
        return private_memory(views, group, layer_stride, block_stride)
    try:
        last = shared_file_of(addrs[-1])
        same = (
            os.fstat(last.fd).st_ino == os.fstat(head.fd).st_ino and last.offset == head.offset + addrs[-1] - addrs[0]
        )
        os.close(last.fd)
        if not same:
            raise ValueError(f"vLLM group {group}: its layers are not in one contiguous mapping of one file")
        return GroupMemory(head.fd, head.size, num_blocks, block_layout_name(head.offset, layer_stride, block_stride))
    except BaseException:
        os.close(head.fd)
        raise


def private_memory(views: Sequence[torch.Tensor], group: int, layer_stride: int, block_stride: int) -> GroupMemory:
    """The views' one allocation (a torch storage) as a buffer of this process, for the copy
    path "engine". Raises ValueError for layers in several allocations."""
    storage = views[0].untyped_storage()
    if any(v.untyped_storage().data_ptr() != storage.data_ptr() for v in views):
        raise ValueError(f"vLLM group {group}: its layers are not in one allocation")
    flat = torch.empty(0, dtype=torch.uint8, device=views[0].device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    offset = views[0].data_ptr() - storage.data_ptr()
    layout = block_layout_name(offset, layer_stride, block_stride)
    return GroupMemory(-1, flat.numel(), views[0].shape[0], layout, private=wrap_tensor(flat))


def _cuda_memory(views: Sequence[torch.Tensor], group: int, layer_stride: int, block_stride: int) -> GroupMemory:
    """vLLM's CUDA allocation of the views, exported by CUDA IPC (torch's own export: the
    caching allocator's segment handle and the storage's offset in it). Written for GPU
    hosts; not run on CI, which has no GPU."""
    storage = views[0].untyped_storage()
    if any(v.untyped_storage().data_ptr() != storage.data_ptr() for v in views):
        raise ValueError(f"vLLM group {group}: its layers are not in one CUDA allocation")
    _device, ipc_handle, size, segment_offset, *_ = storage._share_cuda_()
    offset = views[0].data_ptr() - storage.data_ptr()
    handle = MemoryHandle("cuda_ipc", int(size), ipc_handle=bytes(ipc_handle), offset=int(segment_offset))
    layout = block_layout_name(offset, layer_stride, block_stride)
    return GroupMemory(-1, int(size), views[0].shape[0], layout, handle, views[0].device.index or 0)
