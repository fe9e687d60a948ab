"""KV events (SubscribeEvents, `hicache events`): a router's view of what is on host agrees
with Lookup after a random workload; a slow subscriber loses events, is told, and never
slows the data path; events need the admin token."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import eventually
from sidecar_util import MODEL, ROOT, filled_device, keys_for, mimo_geometries, register, service

from hicache.api import EventBatch, EventKind, EventPool, PoolInfo, Tier
from hicache.cache import HierarchicalCache
from hicache.cache.config import HiCacheConfig
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.events import EventBus, Subscription
from hicache.sidecar.service import HiCacheService
from server import ServerConfig, create_server

ADMIN = "adm-events"
POOL = EventPool("pool-1", "ns", "m@1", "full")


@pytest.fixture
def served() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    hierarchy = HiCacheConfig(extra_config={"dir": os.path.join(d, "tier"), "fsync": False}, ratio=1.0)
    config = ServerConfig(
        socket=os.path.join(d, "hc.sock"),
        admin_token=ADMIN,
        service=ServiceConfig(expected=mimo_geometries(), hierarchy=hierarchy),
    )
    srv, address = create_server(config)
    yield address
    srv.stop(0)
    shutil.rmtree(d, ignore_errors=True)


class View:
    """What a router builds from the events: per pool, the keys on host."""

    def __init__(self) -> None:
        self.host: dict[str, set[bytes]] = {}
        self.storage: dict[str, set[bytes]] = {}
        self.batches: list[EventBatch] = []

    def apply(self, batch: EventBatch) -> None:
        if self.batches:
            last = self.batches[-1]
            assert batch.sequence == last.sequence + len(last.events) + last.dropped, "a gap nobody reported"
        else:
            assert batch.sequence == 1
        self.batches.append(batch)
        for e in batch.events:
            if e.kind is EventKind.POOL_REGISTERED:
                self.host.setdefault(e.pool.pool_id, set())
            elif e.kind is EventKind.POOL_UNREGISTERED:
                self.host.pop(e.pool.pool_id, None)
            else:
                tier = self.host if e.tier is Tier.HOST else self.storage
                keys = tier.setdefault(e.pool.pool_id, set())
                if e.kind is EventKind.STORED:
                    keys.update(e.keys)
                else:
                    keys.difference_update(e.keys)


def follow(address: str, view: View, ready: threading.Event, namespace: str | None = None) -> HiCacheClient:
    """A subscriber on a thread of its own, applying every batch to `view`; returns its client
    (closing it ends the stream)."""
    client = HiCacheClient(address, admin_token=ADMIN, timeout=30)

    def run() -> None:
        try:
            for batch in client.events(namespace, duration=60):
                view.apply(batch)
                ready.set()
        except HiCacheRpcError as exc:  # the client was closed under it: the test is over
            assert exc.code.name == "UNAVAILABLE", exc

    threading.Thread(target=run, daemon=True).start()
    return client


def test_a_routers_view_of_the_host_equals_lookup_after_a_random_workload(served: str) -> None:
    engine = HiCacheClient(served, timeout=30)
    dev = filled_device(8, seed=1)
    first = engine.register(dev, namespace="tenant-a", model_id="mimo@1")
    keys = keys_for(40, seed=2)
    engine.offload(keys[:4], [0, 1, 2, 3], pool=first)  # before the subscriber: reaches it in the snapshot
    view, ready = View(), threading.Event()
    watcher = follow(served, view, ready)
    ready.wait(10)
    rng = random.Random(5)
    second = engine.register(filled_device(8, seed=3), namespace="tenant-b", model_id="mimo@1")
    for _ in range(60):
        pool = rng.choice([first, second])
        op = rng.random()
        chosen = rng.sample(keys, rng.randint(1, 6))
        if op < 0.5:
            engine.offload(chosen, rng.sample(range(8), len(chosen)), pool=pool)
        elif op < 0.7:
            engine.evict(chosen, pool=pool)
        elif op < 0.85:
            engine.evict(num_pages=rng.randint(1, 3), pool=pool)
        else:
            engine.reload(chosen, list(range(len(chosen))), pool=pool)
    third = engine.register(filled_device(8, seed=4), namespace="tenant-c", model_id="mimo@1")
    engine.offload(keys[:3], [0, 1, 2], pool=third)
    engine.unregister(third)

    def on_host(pool: Any) -> set[bytes]:
        looked = engine.lookup(keys, pool=pool)
        return {k for k, t in zip(keys, looked.tiers, strict=True) if t is Tier.HOST}

    want = {first.pool_id: on_host(first), second.pool_id: on_host(second)}
    assert want[first.pool_id] and want[second.pool_id], "the workload left nothing on host"
    eventually(lambda: view.host == want, 20, "the events")
    assert third.pool_id not in view.host  # unregistered: gone with its keys
    assert all(b.dropped == 0 for b in view.batches)
    kinds = {e.kind for b in view.batches for e in b.events}
    assert {EventKind.STORED, EventKind.REMOVED, EventKind.POOL_REGISTERED, EventKind.POOL_UNREGISTERED} <= kinds
    eventually(
        lambda: bool(view.storage.get(first.pool_id)), 20, "a storage event"
    )  # write-through reached the file tier
    watcher.close()
    engine.close()


def test_a_namespace_filter_sees_only_that_tenants_pools(served: str) -> None:
    engine = HiCacheClient(served, timeout=30)
    mine = engine.register(filled_device(8, seed=1), namespace="tenant-a", model_id="mimo@1")
    other = engine.register(filled_device(8, seed=2), namespace="tenant-b", model_id="mimo@1")
    view, ready = View(), threading.Event()
    watcher = follow(served, view, ready, namespace="tenant-a")
    ready.wait(10)
    keys = keys_for(4, seed=3)
    engine.offload(keys, [0, 1, 2, 3], pool=other)
    engine.offload(keys[:2], [0, 1], pool=mine)
    eventually(lambda: view.host.get(mine.pool_id) == set(keys[:2]), 20, "the events")
    assert set(view.host) == {mine.pool_id}
    assert {e.pool.namespace for b in view.batches for e in b.events} == {"tenant-a"}
    watcher.close()
    engine.close()


@pytest.mark.parametrize("metrics_port", [None, 0])  # with metrics, an interceptor wraps every stream
def test_shutdown_ends_open_event_and_health_streams_cleanly_without_waiting_out_the_grace(
    metrics_port: int | None,
) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    d = tempfile.mkdtemp(prefix="hc")
    config = ServerConfig(socket=os.path.join(d, "hc.sock"), admin_token=ADMIN, grace_s=300, metrics_port=metrics_port)
    srv, address = create_server(config)
    ends: dict[str, str] = {}
    done = threading.Event()
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    subscriber = HiCacheClient(address, admin_token=ADMIN, timeout=30)
    subscribed = threading.Event()

    def follow_events() -> None:
        try:
            for _ in subscriber.events(snapshot=False):
                pass
            ends["events"] = "ended"
        except HiCacheRpcError as exc:
            ends["events"] = exc.code.name

    def follow_health() -> None:
        try:
            for _ in health:
                subscribed.set()
            ends["health"] = "ended"
        except grpc.RpcError as exc:
            ends["health"] = exc.code().name

    threads = [threading.Thread(target=f, daemon=True) for f in (follow_events, follow_health)]
    for t in threads:
        t.start()
    try:
        assert subscribed.wait(60)
        eventually(lambda: srv.service.events.subscribers, what="the event subscription")
        stopper = threading.Thread(target=lambda: (srv.stop(), done.set()), daemon=True)
        stopper.start()
        for t in threads:  # well within the 300 s grace: before, both held it all and got UNAVAILABLE
            t.join(60)
        assert ends == {"events": "ended", "health": "ended"}, ends
        assert done.wait(60), "stop() waited for the streams"
    finally:
        srv.stop(0)
        subscriber.close()
        channel.close()
        shutil.rmtree(d, ignore_errors=True)


def test_events_need_the_admin_token(served: str) -> None:
    for token in (None, "wrong"):
        with HiCacheClient(served, admin_token=token, timeout=10) as client:
            with pytest.raises(HiCacheRpcError) as exc:
                next(iter(client.events(duration=30)))  # refused at once; 30 s for a busy machine
            assert exc.value.code.name == "PERMISSION_DENIED" and "KV events" in exc.value.details


def test_a_slow_subscriber_loses_events_is_told_and_never_blocks_the_publisher() -> None:
    bus = EventBus()
    slow = bus.subscribe(max_queued_keys=10)
    for i in range(100):  # nobody reads: every publish returns at once
        bus.publish(EventKind.STORED if i % 2 == 0 else EventKind.REMOVED, POOL, Tier.HOST, [bytes([i])])
    first = slow.next_batch(timeout=1)
    assert first is not None and first.sequence == 1
    assert len(first.events) == 10 and first.dropped == 90 and slow.dropped_total == 90
    bus.publish(EventKind.STORED, POOL, Tier.HOST, [b"after"])
    second = slow.next_batch(timeout=1)
    assert second is not None and second.sequence == 1 + 10 + 90, "lost events use up their numbers"
    assert second.events[0].keys == (b"after",) and second.dropped == 0
    assert slow.next_batch(timeout=0.01) is None
    slow.close()
    assert bus.subscribers == 0


def test_a_snapshot_larger_than_the_queue_is_still_delivered_whole() -> None:
    bus = EventBus()
    sub = bus.subscribe(max_queued_keys=10)
    keys = [bytes([i]) for i in range(50)]
    sub.offer(EventKind.STORED, POOL, Tier.HOST, keys, snapshot=True)  # what a resync starts from
    bus.publish(EventKind.REMOVED, POOL, Tier.HOST, [b"x"])  # the queue is over its limit: this is lost
    batch = sub.next_batch(timeout=1)
    assert batch is not None and batch.events[0].keys == tuple(keys) and batch.dropped == 1


def test_an_event_lost_between_two_pools_snapshots_is_reported_where_it_was_lost() -> None:
    bus = EventBus()
    sub = bus.subscribe(max_queued_keys=4)
    a, b = EventPool("pool-a", "", "m", "full"), EventPool("pool-b", "", "m", "full")
    # what a snapshot (EventBus.subscribe) offers for pool A: its snapshot fills the queue
    sub.offer(EventKind.POOL_REGISTERED, a, Tier.NONE, [], snapshot=True)
    sub.offer(EventKind.STORED, a, Tier.HOST, [bytes([i]) for i in range(4)], snapshot=True)
    bus.publish(EventKind.STORED, a, Tier.HOST, [b"live"])  # lost (number 3), before B's snapshot
    sub.offer(EventKind.POOL_REGISTERED, b, Tier.NONE, [], snapshot=True)
    sub.offer(EventKind.STORED, b, Tier.HOST, [b"b0"], snapshot=True)
    bus.publish(EventKind.STORED, b, Tier.HOST, [b"late"])  # still losing until the loss is read (6)
    first = sub.next_batch(timeout=1)
    assert first is not None and (first.sequence, len(first.events), first.dropped) == (1, 2, 1)
    assert [e.pool for e in first.events] == [a, a]
    second = sub.next_batch(timeout=1)
    assert second is not None and (second.sequence, second.dropped) == (4, 1), "numbered on from the loss"
    assert [(e.kind, e.pool) for e in second.events] == [(EventKind.POOL_REGISTERED, b), (EventKind.STORED, b)]
    bus.publish(EventKind.STORED, b, Tier.HOST, [b"after"])  # drained: queued again
    third = sub.next_batch(timeout=1)
    assert third is not None and third.sequence == 7 and third.events[0].keys == (b"after",)
    assert sub.dropped_total == 2


def test_a_batch_cut_short_before_a_loss_reports_it_in_the_next_one() -> None:
    bus = EventBus()
    sub = bus.subscribe(max_queued_keys=1)
    sub.offer(EventKind.POOL_REGISTERED, POOL, Tier.NONE, [], snapshot=True)
    bus.publish(EventKind.STORED, POOL, Tier.HOST, [b"x"])  # lost (2)
    sub.offer(EventKind.STORED, POOL, Tier.HOST, [b"y"], snapshot=True)
    batches = [sub.next_batch(timeout=1, max_events=1) for _ in range(3)]
    assert [(b.sequence, len(b.events), b.dropped) for b in batches if b is not None] == [
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 0),
    ]
    assert sub.next_batch(timeout=0.01) is None


def test_consecutive_changes_of_one_pool_and_tier_are_merged() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    for k in (b"a", b"b", b"c"):
        bus.publish(EventKind.STORED, POOL, Tier.HOST, [k])
    bus.publish(EventKind.STORED, POOL, Tier.STORAGE, [b"a"])
    bus.publish(EventKind.REMOVED, POOL, Tier.HOST, [b"b"])
    bus.publish(EventKind.STORED, POOL, Tier.HOST, [])  # no keys: nothing to say
    batch = sub.next_batch(timeout=1)
    assert batch is not None
    assert [(e.kind, e.tier, e.keys) for e in batch.events] == [
        (EventKind.STORED, Tier.HOST, (b"a", b"b", b"c")),
        (EventKind.STORED, Tier.STORAGE, (b"a",)),
        (EventKind.REMOVED, Tier.HOST, (b"b",)),
    ]
    assert batch.sequence == 1


def test_the_events_command_prints_json_lines(served: str) -> None:
    engine = HiCacheClient(served, timeout=30)
    pool = engine.register(filled_device(8, seed=1), namespace="tenant-a", model_id="mimo@1")
    keys = keys_for(2, seed=9)
    engine.offload(keys, [0, 1], pool=pool)
    out = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "events", served, "--duration", "5"],  # the replay arrives at once
        cwd=ROOT,
        env={**os.environ, "HICACHE_ADMIN_TOKEN": ADMIN},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0]["kind"] == "pool_registered" and lines[0]["pool_id"] == pool.pool_id
    stored = [x for x in lines if x["kind"] == "stored" and x["tier"] == "host"]
    assert stored and set(stored[0]["keys"]) == {k.hex() for k in keys}
    assert [x["seq"] for x in lines] == list(range(1, len(lines) + 1))
    engine.close()
    refused = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "events", served, "--duration", "10", "--admin-token", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr


# ---- pools that come and go while a subscription starts ----------------------------------------
def drained(sub: Subscription) -> View:
    """A router's view of everything queued for `sub` now."""
    view = View()
    while (batch := sub.next_batch(timeout=0)) is not None:
        view.apply(batch)
    return view


def announced(view: View, kind: EventKind) -> list[str]:
    return [e.pool.pool_id for b in view.batches for e in b.events if e.kind is kind]


class NotingLock:
    """The event bus's lock, noting (in `waiting`) when `thread` starts to wait for it."""

    def __init__(self, lock: Any, thread: threading.Thread, waiting: threading.Event):
        self.lock, self.thread, self.waiting = lock, thread, waiting

    def __enter__(self) -> None:
        if threading.current_thread() is self.thread:
            self.waiting.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def during_the_snapshot(
    svc: HiCacheService, monkeypatch: pytest.MonkeyPatch, action: Callable[[], object]
) -> threading.Thread:
    """Make the first pool snapshot a subscription takes start `action` on a thread of its own,
    and take the snapshot once the action has finished or waits for the event bus (which the
    subscriber may hold). Call it before the pools register: a pool hands the bus its snapshot
    function then. Returns the thread."""
    reached = threading.Event()

    def run() -> None:
        try:
            action()
        finally:
            reached.set()

    thread = threading.Thread(target=run, daemon=True)
    monkeypatch.setattr(svc.events, "_lock", NotingLock(svc.events._lock, thread, reached))
    original = HierarchicalCache.with_host_keys

    def snapshot(cache: HierarchicalCache, fn: Callable[[list[bytes]], None]) -> None:
        if thread.ident is None:  # the first snapshot
            thread.start()
            assert reached.wait(60), "the action neither finished nor reached the bus"  # a bound on a hang
        original(cache, fn)

    monkeypatch.setattr(HierarchicalCache, "with_host_keys", snapshot)
    return thread


def test_a_pool_unregistered_while_a_subscriber_takes_its_snapshot_stays_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the pool's POOL_UNREGISTERED went out live first and its snapshot (registered,
    host keys) after it: a router kept a dead pool for good."""
    svc, dev = service(tmp_path), filled_device(4)
    try:
        box: list[str] = []
        unregistering = during_the_snapshot(svc, monkeypatch, lambda: svc.unregister("u1", box[0]))
        info = register(svc, dev)
        box.append(info.pool_id)
        keys = keys_for(2, seed=1)
        svc.offload("o1", info.pool_id, keys, [0, 1])
        sub = svc.subscribe()
        unregistering.join(60)
        assert not unregistering.is_alive() and svc.pool_ids == []
        view = drained(sub)
        assert view.host == {}, "the router still has the unregistered pool"
        assert announced(view, EventKind.POOL_REGISTERED) == [info.pool_id]
        assert announced(view, EventKind.POOL_UNREGISTERED) == [info.pool_id]
        assert view.batches[-1].events[-1].kind is EventKind.POOL_UNREGISTERED
    finally:
        svc.close()
        dev.close()


def test_a_pool_registered_while_a_subscription_starts_is_announced_to_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The subscription starts after the new pool announced itself but before the service
    listed it. Before, it got neither the live POOL_REGISTERED nor the pool in its snapshot,
    then the pool's STORED events."""
    svc, dev = service(tmp_path), filled_device(4)
    subs: list[Subscription] = []
    add = svc._pools.add

    def subscribe_first(pool: Any) -> str:
        subs.append(svc.subscribe())
        return add(pool)

    monkeypatch.setattr(svc._pools, "add", subscribe_first)
    try:
        info = register(svc, dev)
        keys = keys_for(2, seed=2)
        svc.offload("o1", info.pool_id, keys, [0, 1])
        (sub,) = subs
        view = drained(sub)
        assert announced(view, EventKind.POOL_REGISTERED) == [info.pool_id]
        assert view.host == {info.pool_id: set(keys)}
    finally:
        svc.close()
        dev.close()


def test_a_pool_registered_while_a_subscriber_takes_its_snapshot_is_announced_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool that registers while the subscriber snapshots another is announced to it once:
    in the snapshot or live after it, never both."""
    svc, first_dev, second_dev = service(tmp_path), filled_device(4), filled_device(4, seed=1)
    try:
        second: list[str] = []

        def register_second() -> None:
            info = svc.register(
                "reg-b",
                geometry=second_dev.geometry,
                device_pages=4,
                device_memory=second_dev.handle,
                model_id=MODEL + "-b",  # of one model, they would share one host cache
            )
            assert isinstance(info, PoolInfo)
            second.append(info.pool_id)

        registering = during_the_snapshot(svc, monkeypatch, register_second)
        first = register(svc, first_dev).pool_id
        sub = svc.subscribe()
        registering.join(60)
        assert not registering.is_alive() and len(second) == 1
        keys = keys_for(2, seed=3)
        svc.offload("o1", second[0], keys, [0, 1])
        view = drained(sub)
        assert sorted(announced(view, EventKind.POOL_REGISTERED)) == sorted([first, second[0]])
        assert view.host == {first: set(), second[0]: set(keys)}
    finally:
        svc.close()
        first_dev.close()
        second_dev.close()
