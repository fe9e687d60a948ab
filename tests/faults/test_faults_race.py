"""Evict racing reload of the same key: the reload serves the page exact or NOT_FOUND, never a
page half overwritten by the offload that reused its host page."""

from __future__ import annotations

import threading

import torch
from sidecar_util import filled_device, keys_for, make_service

from hicache.api import KeyStatus, PoolInfo
from hicache.cache.config import HiCacheConfig

S = KeyStatus
ITERATIONS = 150


def test_evict_and_reuse_racing_reload_never_serves_a_torn_page():
    # 4 host pages for 16 device pages: every re-offload reuses a just-evicted host page
    svc = make_service(hierarchy=HiCacheConfig(storage_backend="none", ratio=0.25))
    dev = filled_device(16, seed=11)
    info = svc.register("r", geometry=dev.geometry, device_pages=16, device_memory=dev.handle)
    assert isinstance(info, PoolInfo) and info.host_pages == 4
    pid = info.pool_id
    target, others = keys_for(1, seed=1), keys_for(4, seed=2)
    src = {p: dev.read_page(p).clone() for p in range(5)}  # target <- page 0, others <- pages 1..4
    errors: list[str] = []
    outcomes = {S.LOADED: 0, S.NOT_FOUND: 0}
    stop = threading.Event()

    def reader(name: str, scratch: int, layerwise: bool) -> None:
        for i in range(ITERATIONS):
            before = dev.read_page(scratch).clone()
            r = svc.reload(f"{name}-{i}", pid, target, [scratch], layerwise=layerwise)
            if layerwise:
                events = list(svc.watch(pid, r.op_id, poll_s=0.01))
                assert events[-1].kind == "done", events[-1]
            status = r.statuses[0]
            outcomes[status] += 1
            got = dev.read_page(scratch)
            if status == S.LOADED and not torch.equal(got, src[0]):
                errors.append(f"{name} {i}: LOADED but the bytes differ from the page offloaded")
            if status == S.NOT_FOUND and not torch.equal(got, before):
                errors.append(f"{name} {i}: NOT_FOUND but the device page changed")
        stop.set()

    def mutator() -> None:
        i = 0
        while not stop.is_set() and i < 20 * ITERATIONS:
            svc.evict(f"e-{i}", pid, target)  # EVICTED, or BUSY while a reload holds it
            svc.offload(f"o-{i}", pid, others, [1, 2, 3, 4])  # takes every host page it can
            svc.evict(f"n-{i}", pid, num_pages=4)
            svc.offload(f"t-{i}", pid, target, [0])
            i += 1

    threads = [
        threading.Thread(target=reader, args=("plain", 14, False)),
        threading.Thread(target=reader, args=("layerwise", 15, True)),
        threading.Thread(target=mutator),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert outcomes[S.LOADED] + outcomes[S.NOT_FOUND] == 2 * ITERATIONS
    print("reload outcomes under the race:", {s.name: n for s, n in outcomes.items()})
    svc.check_integrity()
    pool = svc.pool(pid)
    assert all(pool.index.refs(k) == 0 for k in pool.index.keys())
    for p in range(1, 5):
        assert torch.equal(src[p], dev.read_page(p))  # sources are never written
    svc.close()
    dev.close()
