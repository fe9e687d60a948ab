"""An engine's own memory layout (SGLang's host pools) shared by fd: the layouts address the
bytes the engine's tensors hold, the sidecar copies straight from and to them, and bad fds,
ids and sizes are refused with the value named."""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator

import pytest
import torch
from sidecar_util import mimo_full

from hicache.api import KeyStatus
from hicache.cache.config import HiCacheConfig
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.geometry import KVGeometry
from hicache.keys import page_keys
from hicache.memory import FdStore, MemoryHandle, fd_socket_path, segment_offsets, send_fds, serve_fds
from hicache.memory.buffer import local_buffer
from hicache.pools.flat import FlatPool
from hicache.pools.layouts import EngineLayout
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.registration import map_engine_layout
from hicache.sidecar.service import HiCacheService
from server import ServerConfig, create_server

ORDERS = EngineLayout.ORDERS
MLA = KVGeometry(attention="mla", layer_num=3, head_num=1, kv_lora_rank=32, qk_rope_head_dim=16, page_size=4)


def engine_tensor(buf: torch.Tensor, g: KVGeometry, index: int, pages: int, order: str) -> torch.Tensor:
    """Buffer `index` of the engine's own tensors over `buf`, shaped as SGLang shapes them:
    [L, S, *row] / [S, L, *row] / [pages, L, P, *row]."""
    spec = g.buffers[index]
    n = g.layer_num * pages * g.page_size * spec.row_bytes
    shape = {
        "sglang_layer_first": (g.layer_num, pages * g.page_size),
        "sglang_page_first": (pages * g.page_size, g.layer_num),
        "sglang_page_first_direct": (pages, g.layer_num, g.page_size),
    }[order]
    return buf[:n].view(getattr(torch, spec.storage_dtype)).view(*shape, *spec.row_shape)


def engine_tensors(buf: torch.Tensor, g: KVGeometry, pages: int, order: str, bases: list[int]) -> list[torch.Tensor]:
    return [engine_tensor(buf[base:], g, i, pages, order) for i, base in enumerate(bases)]


def rows(t: torch.Tensor, order: str, layer: int, page: int, p: int) -> torch.Tensor:
    s = slice(page * p, (page + 1) * p)
    return {"sglang_layer_first": lambda: t[layer, s], "sglang_page_first": lambda: t[s, layer]}.get(
        order, lambda: t[page, layer]
    )()


def canonical(ts: list[torch.Tensor], g: KVGeometry, order: str, page: int) -> bytes:
    """A page in the canonical format ([layer][buffer][token][row]), from the engine's tensors."""
    return b"".join(
        rows(t, order, layer, page, g.page_size).contiguous().view(torch.uint8).numpy().tobytes()
        for layer in range(g.layer_num)
        for t in ts
    )


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("geometry", [mimo_full(page_size=4), MLA], ids=["mimo_k192_v128", "mla"])
@pytest.mark.parametrize("gap", [0, 4096], ids=["one_region", "two_segments"])
def test_engine_layout_addresses_the_engine_tensors(order: str, geometry: KVGeometry, gap: int) -> None:
    g, pages = geometry, 5
    sizes = [g.layer_num * pages * g.page_size * b.row_bytes for b in g.buffers]
    bases = [sum(sizes[:i]) + i * gap for i in range(len(sizes))]
    layout = EngineLayout(g, pages, order, tuple(bases) if gap else None, extent=bases[-1] + sizes[-1] + gap)
    mem = local_buffer(layout.nbytes)
    mem.tensor.random_(0, 256)
    pool = FlatPool(g, layout, mem)
    pool.check_integrity()
    ts = engine_tensors(mem.tensor, g, pages, order, bases)
    for page in range(pages):
        assert pool.read_page(page).numpy().tobytes() == canonical(ts, g, order, page)


def test_engine_layout_refuses_what_does_not_fit() -> None:
    g = mimo_full(page_size=4)
    with pytest.raises(ValueError, match="unknown engine layout 'page_head'"):
        EngineLayout(g, 2, "page_head")
    with pytest.raises(ValueError, match="do not fit at offsets"):
        EngineLayout(g, 2, "sglang_page_first", (0, 10))  # V would overlap K
    with pytest.raises(ValueError, match="the memory holds 100"):
        EngineLayout(g, 2, "sglang_page_first", extent=100)
    fp4 = KVGeometry(layer_num=1, head_num=1, head_dim=32, v_head_dim=32, dtype="fp4_e2m1")
    with pytest.raises(ValueError, match="no scale buffers"):
        EngineLayout(fp4, 1, "sglang_page_first")


class MemfdPool:
    """An engine pool the way SGLang's "allocator": "shm" makes it: one memfd per buffer
    (K, V), each mapped on its own, page-rounded."""

    def __init__(self, g: KVGeometry, pages: int, order: str):
        self.g, self.pages, self.order = g, pages, order
        sizes = [g.layer_num * pages * g.page_size * b.row_bytes for b in g.buffers]
        self.fds, self.maps, self.tensors = [], [], []
        for i, size in enumerate(sizes):
            fd = os.memfd_create(f"test-pool-{i}", os.MFD_CLOEXEC)
            rounded = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
            os.ftruncate(fd, rounded)
            m = mmap.mmap(fd, rounded)
            self.fds.append(fd)
            self.maps.append(m)
            buf = torch.frombuffer(m, dtype=torch.uint8)
            buf.random_(0, 256)
            self.tensors.append(engine_tensor(buf, g, i, pages, order))
        self.offsets, self.total = segment_offsets([os.fstat(fd).st_size for fd in self.fds])

    def page(self, page: int) -> bytes:
        return canonical(self.tensors, self.g, self.order, page)


@pytest.fixture
def served() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    srv, address = create_server(ServerConfig(socket=os.path.join(d, "hc.sock"), service=ServiceConfig()))
    yield address
    srv.stop(0)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("order", ORDERS)
def test_sidecar_copies_straight_from_and_to_memfd_pages(served: str, order: str) -> None:
    g = mimo_full(page_size=4)
    eng = MemfdPool(g, 6, order)
    with HiCacheClient(served) as client:
        ids = client.send_fds(eng.fds)
        handle = MemoryHandle("fd", eng.total, name=",".join(ids))
        client.register_memory(g, eng.pages, handle, device_layout=order)
        keys = page_keys(list(range(3 * g.page_size)), g.page_size)
        want = [eng.page(p) for p in (0, 2, 4)]
        assert client.offload(keys, [0, 2, 4]).statuses == (KeyStatus.STORED,) * 3
        assert client.reload(keys, [5, 3, 1]).statuses == (KeyStatus.LOADED,) * 3
        assert [eng.page(p) for p in (5, 3, 1)] == want


def test_bad_fds_ids_and_sizes_are_refused(served: str) -> None:
    g = mimo_full(page_size=4)
    eng = MemfdPool(g, 2, "sglang_page_first")
    path = served.removeprefix("unix://")
    r, w = os.pipe()
    with pytest.raises(ValueError, match="is not a non-empty regular file"):
        send_fds(path, [r])
    with socket.socket(socket.AF_UNIX) as s:  # a pipe sent anyway: the sidecar refuses it too
        s.connect(fd_socket_path(path))
        import array

        s.sendmsg([b"HCFD1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
        assert b"not a non-empty regular file" in s.makefile("rb").readline()
    os.close(r)
    os.close(w)
    with HiCacheClient(served) as client:
        with pytest.raises(HiCacheRpcError, match="unknown or expired fd id"):
            client.register_memory(
                g, 2, MemoryHandle("fd", eng.total, name="fd-nope"), device_layout="sglang_page_first"
            )
        with pytest.raises(HiCacheRpcError, match="needs a device_layout"):
            client.register_memory(g, 2, MemoryHandle("fd", eng.total, name="x"))
        ids = client.send_fds(eng.fds)
        # 2 pages of memory, 9 claimed: refused by arithmetic, before anything is mapped or sized
        with pytest.raises(HiCacheRpcError, match=r"needs \d+ bytes, the memory holds \d+ \(device_pages=9\)"):
            client.register_memory(
                g, 9, MemoryHandle("fd", eng.total, name=",".join(ids)), device_layout="sglang_page_first"
            )
        ids = client.send_fds(eng.fds)
        with pytest.raises(HiCacheRpcError, match="map to"):  # a handle whose size disagrees with the fds
            client.register_memory(
                g, 2, MemoryHandle("fd", eng.total + 1, name=",".join(ids)), device_layout="sglang_page_first"
            )
        with pytest.raises(HiCacheRpcError, match="unknown device layout"):
            client.register_memory(g, 2, MemoryHandle("fd", eng.total, name="x"), device_layout="sideways")


def test_fd_store_takes_each_id_once_and_expires_unclaimed_ones() -> None:
    store = FdStore(ttl_s=60)
    fid = store.add(os.memfd_create("a"))
    assert len(store.take([fid])) == 1
    with pytest.raises(ValueError, match="unknown or expired"):
        store.take([fid])
    stale = FdStore(ttl_s=-1)  # already past its deadline when added
    gone = stale.add(os.memfd_create("b"))
    with pytest.raises(ValueError, match="unknown or expired"):
        stale.take([gone])


def test_fd_store_refuses_a_repeated_id_and_takes_nothing() -> None:
    store = FdStore(ttl_s=60)
    a, b = store.add(os.memfd_create("a")), store.add(os.memfd_create("b"))
    with pytest.raises(ValueError, match=rf"fd id\(s\) \['{a}'\] given more than once"):
        store.take([a, b, a])
    fds = store.take([a, b])  # both still there: nothing was popped
    assert len(fds) == 2
    for fd in fds:
        os.close(fd)


def test_a_registration_naming_one_fd_twice_is_invalid_and_leaks_nothing() -> None:
    g = mimo_full(page_size=4)
    eng = MemfdPool(g, 2, "sglang_layer_first")
    svc = HiCacheService(ServiceConfig(hierarchy=HiCacheConfig(storage_backend="none")))
    try:
        fid = svc.fds.add(os.dup(eng.fds[0]))
        handle = MemoryHandle("fd", eng.total, name=f"{fid},{fid}")
        with pytest.raises(ValueError, match=f"{fid}.*given more than once"):
            svc.register("r", geometry=g, device_pages=2, device_memory=handle, device_layout="sglang_layer_first")
        (fd,) = svc.fds.take([fid])  # still the store's, not taken and lost
        os.close(fd)
    finally:
        svc.close()


def test_fd_store_expire_closes_unclaimed_fds_without_other_traffic() -> None:
    store = FdStore(ttl_s=-1)  # already past its deadline when added
    r, w = os.pipe()
    fid = store.add(r)
    os.write(w, b"x")  # the read end is open: nothing expires until someone asks
    assert store.expire() == 1
    with pytest.raises(BrokenPipeError):  # the read end is closed now
        os.write(w, b"x")
    with pytest.raises(ValueError, match="unknown or expired"):
        store.take([fid])
    assert store.expire() == 0
    os.close(w)


def test_received_fds_are_close_on_exec() -> None:
    """A process the sidecar starts must not inherit the engines' memory."""
    d = tempfile.mkdtemp(prefix="hc")
    store = FdStore(ttl_s=60)
    listener = serve_fds(fd_socket_path(os.path.join(d, "hc.sock")), store)
    sent = os.memfd_create("sent", 0)  # not close-on-exec here: the flag is per process
    os.ftruncate(sent, 4096)
    try:
        (fid,) = send_fds(os.path.join(d, "hc.sock"), [sent])
        (got,) = store.take([fid])
        assert fcntl.fcntl(got, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        os.close(got)
    finally:
        os.close(sent)
        listener.close()
        store.close()
        shutil.rmtree(d, ignore_errors=True)


def _memfd_links(name: str) -> list[str]:
    """This process's open fds and mappings of memfd `name`."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the fd listdir itself used
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    return [x for x in fds + maps if f"/memfd:{name} " in x + " "]


# rows of 96 bytes: 2 layers * 5 pages * 4 tokens * 96 = 3840 bytes per buffer, not a whole mmap page
SHORT = KVGeometry(layer_num=2, head_num=1, head_dim=48, v_head_dim=48, page_size=4)


@pytest.mark.parametrize(
    ("sizes", "short"),
    [
        ((3840 - 1000, 3840), 0),
        ((3840, 3840 - 1), 1),
        ((2 * 3840 - 100,), 0),
        ((3840, 3840), None),
        ((2 * 3840,), None),
    ],
    ids=["k_memfd_short", "v_memfd_short", "one_memfd_short", "exact_k_and_v", "exact_one"],
)
def test_each_memfd_must_hold_its_whole_region_not_just_its_page_rounded_place(
    sizes: tuple[int, ...], short: int | None
) -> None:
    """A memfd up to a page shorter than the buffer it holds still gets a page-rounded place
    in the mapping: its own size is what counts. Refused naming it, with nothing left open."""
    store = FdStore(ttl_s=60)
    name = f"hc-short-{os.getpid()}"
    fds = []
    for size in sizes:
        fds.append(os.memfd_create(name, os.MFD_CLOEXEC))
        os.ftruncate(fds[-1], size)
    ids = [store.add(os.dup(fd)) for fd in fds]
    handle = MemoryHandle("fd", segment_offsets(list(sizes))[1], name=",".join(ids))
    try:
        if short is None:
            pool = map_engine_layout(SHORT, 5, handle, "sglang_layer_first", store)
            pool.memory.close()
        else:
            needs = (2 * 3840) if len(sizes) == 1 else 3840
            with pytest.raises(ValueError) as err:
                map_engine_layout(SHORT, 5, handle, "sglang_layer_first", store)
            assert str(err.value) == (
                f"fd segment {short} ({ids[short]}) holds {sizes[short]} bytes, "
                f"device layout 'sglang_layer_first' of 5 pages needs {needs} of it"
            )
        assert len(_memfd_links(name)) == len(fds)  # the test's own fds: no dup, no mapping left
    finally:
        for fd in fds:
            os.close(fd)
        store.close()
