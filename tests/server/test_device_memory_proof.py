"""Device memory a caller may name: the sidecar maps a shared-memory segment only with the
proof its creator holds, so a caller with the TCP token cannot have it read or write another
file in /dev/shm (an application's state, another pool's device segment, a progress block,
a host pool), and a refused name gets one answer whether or not the file exists."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from sidecar_util import filled_device, mimo_geometries

from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.memory import MemoryHandle, create_shm, owns_shm, shm_dir
from hicache.sidecar.config import ServiceConfig
from server import ServerConfig, create_server

TOKEN = "tcp-token"


@pytest.fixture
def tcp() -> Iterator[str]:
    """A sidecar listening on loopback TCP with a token (and its Unix socket)."""
    d = tempfile.mkdtemp(prefix="hc")
    config = ServerConfig(
        socket=os.path.join(d, "hc.sock"),
        listen="127.0.0.1:0",
        token=TOKEN,
        service=ServiceConfig(expected=mimo_geometries()),
    )
    srv, _ = create_server(config)
    try:
        yield srv.addresses[1]
    finally:
        srv.stop(0)
        shutil.rmtree(d, ignore_errors=True)


def refusal(client: HiCacheClient, memory: MemoryHandle, pages: int) -> str:
    """The sidecar's answer to registering `memory` as `pages` device pages: the error's
    code and message, with the segment's name taken out."""
    g = mimo_geometries()["full"]
    with pytest.raises(HiCacheRpcError) as exc:
        client.register_memory(g, pages, memory)
    return f"{exc.value.code.name}: {exc.value.details}".replace(memory.name, "<name>")


def test_a_create_shm_segment_carries_a_proof_only_its_creator_holds() -> None:
    buf = create_shm(4096)
    try:
        h = buf.handle
        assert len(h.proof) == 32 and h.proof not in h.name and h.proof not in repr(h)
        assert owns_shm(h.name, h.proof)
        assert not owns_shm(h.name, "")
        assert not owns_shm(h.name, h.proof[:-1] + ("0" if h.proof[-1] != "0" else "1"))
        other = create_shm(4096)
        assert not owns_shm(h.name, other.handle.proof) and not owns_shm(other.handle.name, h.proof)
        other.close()
        assert not owns_shm("victim-app-state", h.proof)
    finally:
        buf.close()


def test_tcp_caller_cannot_register_a_file_in_dev_shm_and_learns_nothing_of_it(tcp: str) -> None:
    g = mimo_geometries()["full"]
    pages = 2
    nbytes = g.pool_bytes(pages)
    victim = os.path.join(shm_dir(), f"victim-app-state-{secrets.token_hex(4)}")
    content = os.urandom(nbytes)
    with open(victim, "wb") as f:
        f.write(content)
    owned_look = f"hicache-1-1-1-{secrets.token_hex(12)}"  # the form of hicache's names, no proof
    try:
        with HiCacheClient(tcp, token=TOKEN, timeout=10, retries=0) as client:
            answers = {
                refusal(client, MemoryHandle("shm", nbytes, name=os.path.basename(victim)), pages),
                refusal(client, MemoryHandle("shm", 512, name=os.path.basename(victim)), pages),  # wrong size
                refusal(client, MemoryHandle("shm", nbytes, name=f"absent-{secrets.token_hex(4)}"), pages),
                refusal(client, MemoryHandle("shm", nbytes, name=owned_look, proof="0" * 32), pages),
            }
            assert len(answers) == 1, answers  # exists or not, any size: one answer
            (answer,) = answers
            assert answer.startswith("INVALID_ARGUMENT") and "is refused" in answer and "holds" not in answer
        with open(victim, "rb") as f:
            assert f.read() == content  # never mapped, never written
    finally:
        os.unlink(victim)


def test_another_pools_segments_are_refused_and_an_own_segment_registers_over_tcp(tcp: str) -> None:
    a, b = filled_device(2, seed=1), filled_device(2, seed=2)
    try:
        with (
            HiCacheClient(tcp, token=TOKEN, timeout=10, retries=0) as owner,
            HiCacheClient(tcp, token=TOKEN, timeout=10, retries=0) as other,
        ):
            info = owner.register(a)  # the owner's own segment, with its proof, over TCP
            g, n = a.geometry, a.num_pages
            theirs = [
                MemoryHandle("shm", a.nbytes, name=a.handle.name),  # A's device segment, no proof
                MemoryHandle("shm", a.nbytes, name=a.handle.name, proof=b.handle.proof),  # with B's proof
                MemoryHandle("shm", g.pool_bytes(info.host_pages), name=info.host_shm_name),  # A's host pool
            ]
            if info.progress_shm_name:
                theirs.append(MemoryHandle("shm", a.nbytes, name=info.progress_shm_name))
            for memory in theirs:
                assert "is refused" in refusal(other, memory, n)
            mine = other.register_memory(g, n, b.handle)  # B's own segment still registers
            assert mine.pool_id != info.pool_id
    finally:
        a.close()
        b.close()
