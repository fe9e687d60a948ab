"""The bookkeeping of the interprocess CUDA events, up to the CUDA runtime calls it makes.

No GPU here: cupy's runtime is replaced by a recorder of the calls (made, recorded, waited
on, destroyed), so that these tests check which event each slot, layer and ready_event
names. That the events order real copies is checked on a GPU by scripts/gpu_ipc_check.py.
The CUDA device a pool's memory is allocated, opened and registered on is checked the same
way: cupy's Device records the index it is entered with.
"""

from __future__ import annotations

import contextlib
import logging
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sidecar_util import filled_device
from tier_helpers import GEOMETRIES, MemoryTier, identity

from hicache.cache.tiering import HierarchicalCache
from hicache.client import HiCacheClient
from hicache.client import cuda_events as client_events
from hicache.memory import MemoryHandle, cuda, cuda_events
from hicache.memory.cuda_events import EVENT_HANDLE_BYTES, OpenedIpcEvents
from hicache.pools import HostKVPool
from hicache.sidecar.layer_events import LayerEvents
from hicache.sidecar.pool import RegisteredPool
from hicache.sidecar.registration import PoolIdentity
from hicache.sidecar.shared_cache import SharedHostCache

OPENED = 1000  # an opened event's number: the exporter's + OPENED


class Runtime:
    """Stands in for cupy.cuda.runtime: events are numbers, handles encode them."""

    eventDisableTiming, eventInterprocess = 2, 4

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.made = 0
        self.fail_destroy: set[int] = set()

    def eventCreateWithFlags(self, flags: int) -> int:
        assert flags == self.eventDisableTiming | self.eventInterprocess
        self.made += 1
        return self.made

    def ipcGetEventHandle(self, event: int) -> bytes:
        return event.to_bytes(EVENT_HANDLE_BYTES, "little")

    def ipcOpenEventHandle(self, handle: bytes) -> int:
        return int.from_bytes(handle, "little") + OPENED

    def eventRecord(self, event: int, stream: int) -> None:
        self.calls.append(("record", event, stream))

    def streamWaitEvent(self, stream: int, event: int, flags: int) -> None:
        self.calls.append(("wait", stream, event))

    def eventDestroy(self, event: int) -> None:
        self.calls.append(("destroy", event))
        if event in self.fail_destroy:
            raise RuntimeError(f"destroy {event} failed")


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> Runtime:
    runtime = Runtime()
    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Device=lambda index: contextlib.nullcontext()))
    monkeypatch.setattr(cuda_events, "_cupy", lambda: fake)
    monkeypatch.setattr(client_events, "_current_stream", lambda device: 55)
    return runtime


def test_a_reloads_slot_records_its_own_events_layer_by_layer_and_comes_back(rt: Runtime) -> None:
    events = LayerEvents(layer_num=3, device=0, slots=4)
    assert len(events.handles) == 12 and rt.made == 12
    assert [events.acquire() for _ in range(5)] == [0, 1, 2, 3, None]  # the fifth follows Watch
    record = events.recorder(2)
    for position in range(3):
        record(position, 77)
    assert rt.calls == [("record", 7, 77), ("record", 8, 77), ("record", 9, 77)]  # slot 2: events 7..9
    events.release(2)
    assert events.acquire() == 2
    events.close()
    assert sorted(c[1] for c in rt.calls if c[0] == "destroy") == list(range(1, 13))


def test_the_client_waits_on_the_slots_layer_and_names_ready_events_in_a_ring(rt: Runtime) -> None:
    sidecar = LayerEvents(layer_num=3, device=0, slots=4)
    ours = client_events.PoolCudaEvents.create(0)
    ours.open_layer_events(sidecar.handles, sidecar.slots)
    wait = ours.layer_waiter(2, 3)
    assert wait is not None
    wait(1)
    assert rt.calls[-1] == ("wait", 55, 8 + OPENED)  # slot 2, layer 1: the sidecar's event 8
    assert ours.layer_waiter(4, 3) is None and ours.layer_waiter(0, 2) is None  # no such slot; other layers
    numbers = [ours.record_ready() for _ in range(client_events.OFFLOAD_EVENTS + 1)]
    assert numbers == [*range(1, client_events.OFFLOAD_EVENTS + 1), 1]  # 1-based, around the ring
    first_offload_event = 12 + 1  # made after the sidecar's twelve
    assert rt.calls[-1] == ("record", first_offload_event, 55)
    ours.close()
    sidecar.close()


def test_malformed_layer_events_leave_the_reloads_to_watch(rt: Runtime, caplog: pytest.LogCaptureFixture) -> None:
    ours = client_events.PoolCudaEvents.create(0)
    with caplog.at_level(logging.WARNING, "hicache.client"):
        ours.open_layer_events([bytes(EVENT_HANDLE_BYTES)] * 5, 4)
        ours.open_layer_events([bytes(EVENT_HANDLE_BYTES - 1)] * 4, 4)
    assert ours.layers is None and ours.layer_waiter(0, 1) is None
    assert "5 handles for 4 slots" in caplog.text and "layer_event_handles[0] must be a 64-byte" in caplog.text


def test_closing_destroys_every_event_even_after_one_fails(rt: Runtime) -> None:
    events = OpenedIpcEvents([n.to_bytes(EVENT_HANDLE_BYTES, "little") for n in (1, 2, 3)])
    rt.fail_destroy = {1 + OPENED}
    with pytest.raises(RuntimeError, match="destroy 1001 failed"):
        events.close()
    assert [c for c in rt.calls if c[0] == "destroy"] == [("destroy", 1001), ("destroy", 1002), ("destroy", 1003)]
    events.close()  # idempotent: nothing left


def test_an_offloads_ready_event_is_the_engines_event_it_names(rt: Runtime) -> None:
    g = GEOMETRIES["mimo_kv"]
    handles = [n.to_bytes(EVENT_HANDLE_BYTES, "little") for n in range(1, 5)]
    cache = HierarchicalCache(HostKVPool(g, 4, "page_first"), MemoryTier(identity(g)))
    ident = PoolIdentity("p", "full", "", "m", "sha256", 32)
    pool = RegisteredPool(
        ident,
        filled_device(4, geometry=g),
        SharedHostCache(None, cache),
        max_batch=64,
        finished_ops_kept=8,
        offload_events=OpenedIpcEvents(handles),
    )
    assert pool._ready_hook(0) is None
    hook = pool._ready_hook(3)
    assert hook is not None
    hook(9)
    assert rt.calls[-1] == ("wait", 9, 3 + OPENED)  # ready_event 3: the third of the engine's events
    for bad in (5, -1, True):
        with pytest.raises(ValueError, match=rf"ready_event must be 0 or 1\.\.4 .*got {bad!r}"):
            pool._ready_hook(bad)
    pool.close()
    assert ("destroy", 1 + OPENED) in rt.calls  # the engine's events are closed with the pool


class Stop(Exception):
    """Raised by the fake cupy once the device is chosen: nothing past that is faked."""


def stop(*args: object) -> None:
    raise Stop


@pytest.fixture
def entered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The device indices the memory code enters, with current device 3 (a TP rank's, after
    torch.cuda.set_device(3))."""
    indices: list[int] = []

    def device(index: int) -> contextlib.nullcontext[None]:
        indices.append(index)
        return contextlib.nullcontext()

    runtime = SimpleNamespace(ipcOpenMemHandle=stop)
    fake = SimpleNamespace(cuda=SimpleNamespace(Device=device, Memory=stop, runtime=runtime))
    monkeypatch.setattr(cuda, "_cupy", lambda: fake)
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    return indices


def test_cuda_means_the_current_device_not_device_0(entered: list[int]) -> None:
    handle = MemoryHandle("cuda_ipc", 4096, ipc_handle=bytes(64))
    for device in ("cuda", "cuda:1"):
        with pytest.raises(Stop):
            cuda.alloc_device(4096, device)
        with pytest.raises(Stop):
            cuda.open_cuda_ipc(handle, device)
        with pytest.raises(Stop):
            cuda.CudaIpcOpens().open(handle, device)
    assert entered == [3, 3, 3, 1, 1, 1]
    assert cuda.cuda_index("cuda:0") == 0 and cuda.cuda_index("cuda") == 3


def test_register_announces_the_device_the_pool_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    client = HiCacheClient("unix:///nonexistent/hc.sock")  # a channel connects on its first call: none here
    sent: list[int] = []
    monkeypatch.setattr(client, "register_memory", lambda *a, cuda_device, **kw: sent.append(cuda_device))

    def pool(device: torch.device) -> Any:
        flat = SimpleNamespace(device=device, is_cuda=device.type == "cuda")
        memory = MemoryHandle("cuda_ipc" if flat.is_cuda else "shm", 1)  # memory the sidecar maps
        return SimpleNamespace(geometry=None, num_pages=1, handle=memory, flat=flat)

    client.register(pool(torch.device("cuda", 1)))
    client.register(pool(torch.device("cuda")))  # no index: the current device
    client.register(pool(torch.device("cpu")))
    client.register(pool(torch.device("cuda", 1)), cuda_device=2)  # told: as told
    assert sent == [1, 3, 0, 2]
    client.close()


def test_a_host_buffer_cuda_refuses_to_pin_stays_pageable_and_usable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """cudaHostRegister fails (the memlock limit): the pool is not refused, it stays pageable,
    a warning says so, and the buffer is still released (unlinked) as usual."""
    from hicache.memory.shm import create_shm, shm_dir

    def refuse(ptr: int, nbytes: int, flags: int) -> None:
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory")

    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(hostRegister=refuse)))
    monkeypatch.setattr(cuda, "_cupy", lambda: fake)
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    buf = create_shm(1 << 16)
    name = buf.handle.name
    with caplog.at_level("WARNING", logger="hicache.memory.cuda"):
        assert cuda.pin_host(buf) is False  # before: the error failed the registration
    assert "not pinned" in caplog.text and "out of memory" in caplog.text
    buf.tensor.fill_(7)
    assert int(buf.tensor[-1]) == 7
    buf.close()
    assert not os.path.exists(os.path.join(shm_dir(), name))
