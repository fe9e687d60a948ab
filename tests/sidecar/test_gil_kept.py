"""The sidecar's path for a small Offload or Reload keeps the GIL from start to end.

A call that lets go of the GIL must take it back, and beside a busy Python thread (a gRPC
worker, the growth thread) that can cost a switch interval (5 ms). So the service's path for
a 1-page transfer calls nothing that lets go of it: no os function (os.fstat, os.urandom
behind secrets, ...), and the C copy keeps it below HOLD_GIL_BYTES (its own count,
_native.gil_releases()). The calls are recorded with a profile hook, not timed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sidecar_util import filled_device, keys_for, make_service

from hicache.api import KeyStatus
from hicache.memory import buffer
from hicache.memory.buffer import shrunk
from hicache.sidecar.operations import Operation
from hicache.transfer import native

# the modules whose functions let go of the GIL around a system call, or may
LETS_GO = {"posix", "select", "_socket", "_io", "_ssl", "mmap"}
TIME_KEEPS = {"perf_counter", "monotonic", "time", "perf_counter_ns", "monotonic_ns", "time_ns"}
needs_c = pytest.mark.skipif(
    not native.available() or not buffer.FD_SIZE_KEEPS_GIL,
    reason="the C extensions are not built (the fallbacks let go of the GIL)",
)


def calls_that_let_go(fn: Callable[[], Any]) -> tuple[list[str], int]:
    """Run fn(); the C functions it called that let go of the GIL (by module), and how many
    copies the C copy made without it."""
    seen: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event != "c_call":
            return
        module, name = getattr(arg, "__module__", None), getattr(arg, "__name__", "")
        if module in LETS_GO or (module == "time" and name not in TIME_KEEPS):
            seen.append(f"{module}.{name}")

    before = native._native.gil_releases() if native._native is not None else 0
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    after = native._native.gil_releases() if native._native is not None else 0
    return seen, after - before


@pytest.fixture
def pool() -> Iterator[tuple[Any, str]]:
    svc = make_service()
    dev = filled_device(8)  # POSIX shared memory: every transfer first checks its size
    info = svc.register("reg", geometry=dev.geometry, device_pages=8, device_memory=dev.handle, model_id="m")
    yield svc, info.pool_id
    svc.close()
    dev.close()


@needs_c
def test_a_one_page_offload_and_reload_call_nothing_that_lets_go_of_the_gil(pool: tuple[Any, str]) -> None:
    svc, pool_id = pool
    keys = keys_for(3)
    assert svc.offload("warm", pool_id, keys[:1], [0]).statuses == (KeyStatus.STORED,)  # templates made
    assert svc.reload("warm-r", pool_id, keys[:1], [5]).done

    def calls() -> None:
        assert svc.offload("o", pool_id, keys[1:2], [1]).statuses == (KeyStatus.STORED,)
        assert svc.reload("r", pool_id, keys[:1], [6]).statuses == (KeyStatus.LOADED,)
        assert svc.reload("l", pool_id, keys[1:2], [7], layerwise=True).done  # small: copied before the answer

    lets_go, copies_without_gil = calls_that_let_go(calls)
    assert lets_go == []
    assert copies_without_gil == 0


def test_the_hook_sees_what_lets_go_of_the_gil() -> None:
    """The check above would see an os.fstat or an os.urandom (what the damage check and the
    operation ids used)."""
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        lets_go, _ = calls_that_let_go(lambda: (os.fstat(fd), os.urandom(8)))
    finally:
        os.close(fd)
    assert lets_go == ["posix.fstat", "posix.urandom"]


def test_the_damage_check_reports_a_file_shrunk_under_the_mapping() -> None:
    fd = os.memfd_create("shrinks")
    try:
        os.ftruncate(fd, 8192)
        check = shrunk([fd], [8192], "the engine's memory")
        assert buffer.fd_size(fd) == 8192 == os.fstat(fd).st_size
        assert check() is None
        os.ftruncate(fd, 16384)  # grown: still whole
        assert check() is None
        os.ftruncate(fd, 4096)
        assert check() == "the engine's memory shrank from 8192 to 4096 bytes under the sidecar"
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        check()  # a closed fd is an error, never "not shrunk"


@needs_c
def test_fd_size_refuses_what_is_not_an_open_fd() -> None:
    with pytest.raises(ValueError, match="-1"):
        buffer.fd_size(-1)
    with pytest.raises(TypeError):
        buffer.fd_size("3")  # type: ignore[arg-type]
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError):
        buffer.fd_size(fd)


def test_operation_ids_are_unique_and_a_plain_reload_still_tells_watch_every_layer() -> None:
    svc = make_service()
    dev = filled_device(8)
    try:
        info = svc.register("reg", geometry=dev.geometry, device_pages=8, device_memory=dev.handle, model_id="m")
        keys = keys_for(1)
        svc.offload("o", info.pool_id, keys, [0])
        results = [svc.reload(f"r{i}", info.pool_id, keys, [1 + i % 4]) for i in range(20)]
        ids = [r.op_id for r in results]
        assert len(set(ids)) == 20 and all(i.startswith("op-") and len(i) == 19 for i in ids)
        events = list(svc.watch(info.pool_id, ids[-1]))
        layers = dev.geometry.layer_num
        assert [(e.kind, e.layer, e.layers_done) for e in events] == [
            *(("layer_done", layer, layer + 1) for layer in range(layers)),
            ("done", 0, layers),
        ]
    finally:
        svc.close()
        dev.close()


def test_all_layers_done_at_once_is_what_layer_by_layer_publishes() -> None:
    one_by_one, at_once = Operation("a", 5), Operation("b", 5)
    for layer in range(5):
        one_by_one.layer_done(layer, layer + 1)
    at_once.all_layers_done()
    assert at_once.events_since(0, 0) == one_by_one.events_since(0, 0)
    assert not at_once.finished  # DONE is still the caller's to publish
    at_once.done()
    assert at_once.finished and at_once.events_since(5, 0)[0][0].kind == "done"
