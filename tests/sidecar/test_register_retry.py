"""RegisterPool's idempotent retries hold the pool's secret, so they last only as long as the
pool: once it is released (unregistered, reaped or closed) the same request id registers
anew instead of answering with the released pool."""

from __future__ import annotations

import pytest
from sidecar_util import filled_device, make_service

from hicache.api import PoolInfo
from hicache.pools import DeviceKVPool
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.errors import StateError
from hicache.sidecar.request_cache import RequestCache
from hicache.sidecar.service import HiCacheService


def register(svc: HiCacheService, dev: DeviceKVPool, rid: str) -> PoolInfo:
    info = svc.register(rid, geometry=dev.geometry, device_pages=dev.num_pages, device_memory=dev.handle)
    assert isinstance(info, PoolInfo)
    return info


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_retry_gets_the_live_pool_and_after_unregister_a_new_one() -> None:
    svc, dev = make_service(), filled_device(4)
    try:
        first = register(svc, dev, "reg")
        assert register(svc, dev, "reg") == first  # a retry while the pool lives: the same answer
        assert svc.pool_ids == [first.pool_id]
        svc.unregister("u", first.pool_id)
        again = register(svc, dev, "reg")
        assert again.pool_id != first.pool_id and again.pool_secret != first.pool_secret
        assert svc.pool_ids == [again.pool_id]  # the answer names a live pool
        assert svc.owns(again.pool_id, again.pool_secret)
        with pytest.raises(KeyError):
            svc.owns(first.pool_id, first.pool_secret)
        assert register(svc, dev, "reg") == again  # and retries of it are idempotent again
        svc.check_integrity()
    finally:
        svc.close()
        dev.close()


def test_a_reaped_pools_answer_is_not_handed_out() -> None:
    clock = FakeClock()
    svc = HiCacheService(ServiceConfig(lease_timeout_s=10), clock=clock)
    dev = filled_device(4)
    try:
        first = register(svc, dev, "reg")
        clock.now = 11
        assert svc.reap_expired() == [first.pool_id]
        again = register(svc, dev, "reg")
        assert again.pool_id != first.pool_id and svc.pool_ids == [again.pool_id]
    finally:
        svc.close()
        dev.close()


def test_after_close_a_retry_is_refused_not_answered_with_a_released_pool() -> None:
    svc, dev = make_service(), filled_device(4)
    try:
        register(svc, dev, "reg")
        svc.close()
        with pytest.raises(StateError, match="shut down"):
            register(svc, dev, "reg")
    finally:
        dev.close()


def test_forget_drops_only_matching_finished_answers_of_the_scope() -> None:
    rc = RequestCache(capacity=8)
    rc.run(("register", ""), "a", "d", lambda: "pool-1")
    rc.run(("register", ""), "b", "d", lambda: "pool-2")
    rc.run(("pin", "pool-1"), "a", "d", lambda: "pool-1")
    assert rc.forget(("register", ""), lambda answer: answer == "pool-1") == 1
    assert rc.run(("register", ""), "a", "d", lambda: "pool-3") == "pool-3"  # ran anew
    assert rc.run(("register", ""), "b", "d", lambda: "rerun") == "pool-2"  # kept
    assert rc.run(("pin", "pool-1"), "a", "d", lambda: "rerun") == "pool-1"  # another scope: kept
