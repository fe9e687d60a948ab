"""An engine that keeps each (layer, page) as one block at offset + layer * layer_stride +
page * block_stride (vLLM's KV cache): the layout addresses exactly those bytes, the sidecar
maps the engine's memfd found by address and copies blocks straight, and bad names, strides
and sizes are refused with the value named."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch
from sidecar_util import mimo_full

from hicache.api import KeyStatus
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.geometry import KVGeometry
from hicache.keys import page_keys
from hicache.memory import MemoryHandle, create_shm, shared_file_of
from hicache.memory.buffer import local_buffer
from hicache.pools.flat import FlatPool
from hicache.pools.layouts import BlockLayout, block_layout_name, check_engine_layout
from hicache.sidecar.config import ServiceConfig
from server import ServerConfig, create_server

MLA = KVGeometry(attention="mla", layer_num=3, head_num=1, kv_lora_rank=32, qk_rope_head_dim=16, page_size=4)


def block(
    mem: torch.Tensor, offset: int, layer_stride: int, block_stride: int, g: KVGeometry, layer: int, page: int
) -> bytes:
    start = offset + layer * layer_stride + page * block_stride
    return mem[start : start + g.page_bytes_for(1)].numpy().tobytes()


@pytest.mark.parametrize("geometry", [mimo_full(page_size=4), MLA], ids=["mimo_k192_v128", "mla"])
@pytest.mark.parametrize("packed", [False, True], ids=["layer_compact", "block_outermost"])
def test_block_layout_reads_each_layers_block_as_the_pages_chunks(geometry: KVGeometry, packed: bool) -> None:
    g, pages, offset = geometry, 5, 256
    layer = g.page_bytes_for(1)
    strides = (layer, g.layer_num * layer + 64) if packed else (pages * layer + 128, layer)  # with gaps
    extent = offset + (g.layer_num - 1) * strides[0] + (pages - 1) * strides[1] + layer
    pool = FlatPool(g, BlockLayout(g, pages, block_layout_name(offset, *strides), extent), local_buffer(extent))
    pool.flat.random_(0, 256)
    pool.check_integrity()
    for page in range(pages):  # a canonical page is [layer][buffer][token][row]: the blocks in layer order
        want = b"".join(block(pool.flat, offset, *strides, g, lay, page) for lay in range(g.layer_num))
        assert pool.read_page(page).numpy().tobytes() == want


def test_block_layout_refuses_what_does_not_fit() -> None:
    g = mimo_full(page_size=4)
    layer = g.page_bytes_for(1)
    for bad in ("vllm_blocks:1:2", "vllm_blocks:a:1:1", "vllm_blocks:-1:5:5", "blocks:0:1:1"):
        with pytest.raises(ValueError, match=f"device layout {bad!r}"):
            check_engine_layout(bad)
    with pytest.raises(ValueError, match="would overlap"):
        BlockLayout(g, 2, block_layout_name(0, layer, layer - 1), extent=10**9)
    with pytest.raises(ValueError, match="would overlap"):
        BlockLayout(g, 2, block_layout_name(0, layer - 1, g.page_bytes), extent=10**9)
    need = (g.layer_num - 1) * 2 * layer + layer + layer
    with pytest.raises(ValueError, match=f"needs {need} bytes for 2 pages, the memory holds {need - 1}"):
        BlockLayout(g, 2, block_layout_name(0, 2 * layer, layer), extent=need - 1)


def test_shared_file_of_finds_a_memfd_a_dev_shm_file_and_refuses_private_memory() -> None:
    fd = os.memfd_create("test-kv", os.MFD_CLOEXEC)
    os.ftruncate(fd, 3 * mmap.PAGESIZE)
    m = mmap.mmap(fd, 3 * mmap.PAGESIZE)
    os.close(fd)  # only the mapping holds the memfd now
    try:
        t = torch.frombuffer(m, dtype=torch.uint8)
        found = shared_file_of(t.data_ptr() + mmap.PAGESIZE + 7)
        try:
            assert (found.offset, found.size) == (mmap.PAGESIZE + 7, 3 * mmap.PAGESIZE)
            os.pwrite(found.fd, b"hi", found.offset)  # the same bytes the tensor holds
            assert bytes(t[found.offset : found.offset + 2].tolist()) == b"hi"
        finally:
            os.close(found.fd)
        del t
    finally:
        m.close()
    shm = create_shm(8192)
    try:
        found = shared_file_of(shm.tensor.data_ptr() + 100)
        assert (found.offset, found.size) == (100, 8192)
        os.close(found.fd)
    finally:
        shm.close()
    private = torch.zeros(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"private memory .*memfd or /dev/shm"):
        shared_file_of(private.data_ptr())
    with pytest.raises(ValueError, match="in no mapping"):
        shared_file_of(8)


@pytest.fixture
def served() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    srv, address = create_server(
        ServerConfig(socket=os.path.join(d, "hc.sock"), admin_token="adm", service=ServiceConfig())
    )
    yield address
    srv.stop(0)
    shutil.rmtree(d, ignore_errors=True)


def test_sidecar_copies_an_engines_blocks_straight(served: str) -> None:
    g, pages, offset = mimo_full(page_size=4), 6, 4096
    layer = g.page_bytes_for(1)
    size = offset + g.layer_num * pages * layer
    fd = os.memfd_create("engine-kv", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    mem = torch.frombuffer(m, dtype=torch.uint8)
    mem.random_(0, 256)
    strides = (pages * layer, layer)
    try:
        with HiCacheClient(served) as client:
            found = shared_file_of(mem.data_ptr() + offset)
            (fd_id,) = client.send_fds([found.fd])
            os.close(found.fd)
            name = block_layout_name(found.offset, *strides)
            client.register_memory(g, pages, MemoryHandle("fd", found.size, name=fd_id), device_layout=name)
            keys = page_keys(list(range(2 * g.page_size)), g.page_size)
            want = [[block(mem, offset, *strides, g, lay, p) for lay in range(g.layer_num)] for p in (1, 4)]
            assert client.offload(keys, [1, 4]).statuses == (KeyStatus.STORED,) * 2
            mem.zero_()
            assert client.reload(keys, [0, 5]).statuses == (KeyStatus.LOADED,) * 2
            got = [[block(mem, offset, *strides, g, lay, p) for lay in range(g.layer_num)] for p in (0, 5)]
            assert got == want
            (bad_id,) = client.send_fds([fd])
            too_many = block_layout_name(0, size, layer)  # layers past the end of the memfd
            with pytest.raises(HiCacheRpcError, match=r"INVALID_ARGUMENT: device layout .* needs \d+ bytes"):
                client.register_memory(g, pages, MemoryHandle("fd", size, name=bad_id), device_layout=too_many)
    finally:
        del mem
        m.close()
        os.close(fd)


def test_cuda_memory_in_an_engine_layout_needs_cuda_on_the_sidecar(served: str) -> None:
    g = mimo_full(page_size=4)
    cuda = MemoryHandle("cuda_ipc", 10 * g.page_bytes, ipc_handle=b"\x01" * 64)
    with HiCacheClient(served, admin_token="adm") as client:
        with pytest.raises(HiCacheRpcError, match="needs CUDA on the sidecar, and it has none"):
            client.register_memory(g, 10, cuda, device_layout=block_layout_name(0, g.page_bytes_for(1), g.page_bytes))
        with pytest.raises(HiCacheRpcError, match="'sglang_page_first' needs memory of kind fd or shm, got 'cuda_ipc'"):
            client.register_memory(g, 10, cuda, device_layout="sglang_page_first")
        assert client.stats(all_pools=True) == []  # nothing was left registered


def test_block_layout_refuses_strides_whose_blocks_interleave() -> None:
    g = KVGeometry(layer_num=2, head_num=1, head_dim=8, v_head_dim=8, page_size=1, dtype="float32")
    blk = g.page_bytes_for(1)
    name = block_layout_name(0, blk, blk)  # (layer 1, page 0) would be (layer 0, page 1)
    with pytest.raises(ValueError, match=f"layer stride {blk} and block stride {blk} would overlap"):
        BlockLayout(g, 4, name, extent=10 * blk)
    with pytest.raises(ValueError, match="would overlap"):  # layer-major: a layer's pages must end first
        BlockLayout(g, 4, block_layout_name(0, 3 * blk, blk), extent=10 * blk)
    with pytest.raises(ValueError, match="would overlap"):  # block-major: a block's layers must end first
        BlockLayout(g, 4, block_layout_name(0, blk, blk + 1), extent=10 * blk)
    assert BlockLayout(g, 4, block_layout_name(0, 4 * blk, blk), extent=8 * blk).nbytes == 8 * blk
    assert BlockLayout(g, 4, block_layout_name(0, blk, 2 * blk), extent=8 * blk).nbytes == 8 * blk
