"""Shared test helpers: filling pools with random bytes, comparing pages byte for byte, and
waiting for what other threads or processes do."""

from __future__ import annotations

import os
import select
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from hicache.pools.flat import FlatPool


def fill_random(pool: FlatPool, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.flat.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8, generator=gen))


def page_bytes(pool: FlatPool, page: int, layers: list[int] | None = None) -> list[torch.Tensor]:
    """Every (layer, buffer) chunk of one page, as uint8 tensors (NaN-safe to compare)."""
    g = pool.geometry
    layer_list = range(g.layer_num) if layers is None else layers
    return [pool.chunks(b, page, layer).clone() for layer in layer_list for b in range(len(g.buffers))]


def same_page(a: FlatPool, pa: int, b: FlatPool, pb: int, layers: list[int] | None = None) -> bool:
    return all(torch.equal(x, y) for x, y in zip(page_bytes(a, pa, layers), page_bytes(b, pb, layers), strict=True))


def eventually(condition: Callable[[], object], timeout_s: float = 30.0, what: str = "the condition") -> None:
    """Poll condition() every 20 ms until it is true. Raises AssertionError after timeout_s
    (a bound on a hang, not a timing check)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout_s} s"
        time.sleep(0.02)


def in_forked_child(check: Callable[[], bool], timeout: float = 120.0) -> bool:
    """Fork, run check() in the child and return what it returned there (False if it raised,
    or if it did not answer within `timeout` seconds: the child is then killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = bool(check())
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            return False
        return os.read(r, 1) == b"1"
    finally:
        os.close(r)
        os.waitpid(pid, 0)


@contextmanager
def held_by_another_thread(lock: threading.Lock) -> Iterator[None]:
    """Hold `lock` in another thread for the block: what a fork copies when a thread of the
    parent is inside it (the thread itself is not copied)."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join(10)


def redis_binary(name: str = "redis-server") -> str:
    """The path of `name` (redis-server, redis-cli, openssl for the TLS test). Missing: the
    test skips, or fails where HICACHE_REQUIRE_SERVICES names redis (make test sets it, after
    installing them or saying in one line how to), so a missing service never passes unnoticed."""
    exe = shutil.which(name)
    if exe is not None:
        return exe
    package = "openssl" if name == "openssl" else "redis-server"
    why = f"{name} is not installed (apt-get install {package}; make test and .ci/run get it)"
    if "redis" in os.environ.get("HICACHE_REQUIRE_SERVICES", "").split(","):
        pytest.fail(why)
    pytest.skip(why)
