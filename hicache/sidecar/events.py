"""KV events: which keys each pool has on host and in storage, published to subscribers
(cache-aware routers) as they change.

The data path only appends: publish() takes each matching subscriber's lock for an append
and returns; it never waits for a subscriber. A subscriber whose queue is full loses the
event, which still uses up its sequence number, and its next batch says how many were
lost. Consecutive events of one kind, tier and pool are merged into one (more keys), so a
burst of offloads is one event per call, not one per key.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from hicache.api import EventBatch, EventKind, EventPool, KVEvent, Tier

MAX_QUEUED_KEYS = 1 << 16  # per subscriber: beyond this, new events are dropped

# A pool's host keys for a snapshot: calls its argument with every key on host, under the lock
# its host index publishes its changes under (HierarchicalCache.with_host_keys).
HostKeys = Callable[[Callable[[list[bytes]], None]], None]


class _Pending:
    __slots__ = ("seq", "kind", "pool", "tier", "keys")

    def __init__(self, seq: int, kind: EventKind, pool: EventPool, tier: Tier, keys: list[bytes]):
        self.seq, self.kind, self.pool, self.tier, self.keys = seq, kind, pool, tier, keys

    def frozen(self) -> KVEvent:
        return KVEvent(self.kind, self.pool, self.tier, tuple(self.keys))


class _Lost:
    """A run of lost events (numbers seq .. seq + count - 1) with events queued after it: a
    snapshot event queued while events were being lost. The batch that reaches it ends there
    and reports it in `dropped`."""

    __slots__ = ("seq", "count")

    def __init__(self, seq: int, count: int):
        self.seq, self.count = seq, count


class Subscription:
    """One subscriber's queue. next_batch() blocks for events; close() ends it.

    Once the queue is full, every new event is lost (counted, numbered) until the subscriber
    has drained the queue; the batch that drains it reports them in `dropped`, so what was
    lost always comes right after the events delivered. A snapshot event queued meanwhile
    (one pool's, with another's live event lost before it) ends the run of lost events
    where it is: the batch before it reports them, and the numbers stay in order."""

    def __init__(self, bus: EventBus, namespace: str | None, max_queued_keys: int):
        self.namespace = namespace
        self._bus, self._max = bus, max_queued_keys
        self._cond = threading.Condition()
        self._queue: deque[_Pending | _Lost] = deque()
        self._queued_keys = 0
        self._next_seq = 1  # the number of the next event queued or lost
        self._dropped = 0  # lost since the queue last drained, or since the last _Lost queued
        self._lost_queued = 0  # _Lost entries in the queue: still losing events until they are read
        self.dropped_total = 0
        self.closed = False

    def matches(self, pool: EventPool) -> bool:
        return self.namespace is None or pool.namespace == self.namespace

    def offer(self, kind: EventKind, pool: EventPool, tier: Tier, keys: list[bytes], *, snapshot: bool = False) -> None:
        """Queue an event (merged into the last one when it continues it). snapshot: part of
        the opening snapshot, queued whatever the limit (it is what a resync starts from)."""
        weight = max(1, len(keys))
        with self._cond:
            if self.closed:
                return
            losing = self._dropped or self._lost_queued
            if not snapshot and (losing or self._queued_keys + weight > self._max):
                self._dropped += 1
                self.dropped_total += 1
                self._next_seq += 1
                self._cond.notify()
                return
            if self._dropped:  # a snapshot event: the events lost so far come before it
                self._queue.append(_Lost(self._next_seq - self._dropped, self._dropped))
                self._lost_queued += 1
                self._dropped = 0
            last = self._queue[-1] if self._queue else None
            if isinstance(last, _Pending) and keys and (last.kind, last.pool, last.tier) == (kind, pool, tier):
                last.keys.extend(keys)  # merged into the queued event: no new number
            else:
                self._queue.append(_Pending(self._next_seq, kind, pool, tier, list(keys)))
                self._next_seq += 1
            self._queued_keys += weight
            self._cond.notify()

    def next_batch(self, timeout: float | None = None, max_events: int = 256) -> EventBatch | None:
        """The queued events (at most max_events), waiting up to `timeout` s for one; None
        on timeout, or once closed with nothing left."""
        with self._cond:
            if not self._queue and not self._dropped and not self.closed:
                self._cond.wait(timeout)
            if not self._queue and not self._dropped:
                return None
            events, lost = self._pop_events(max_events)
            self._queued_keys -= sum(max(1, len(e.keys)) for e in events)
            if lost is not None:  # lost before the events queued after them
                dropped, first_lost = lost.count, lost.seq
            elif not self._queue:  # drained: what was lost since
                dropped, self._dropped = self._dropped, 0
                first_lost = self._next_seq - dropped
            else:
                dropped, first_lost = 0, self._next_seq
            first = events[0].seq if events else first_lost
            return EventBatch(first, tuple(e.frozen() for e in events), dropped, time.time())

    def _pop_events(self, max_events: int) -> tuple[list[_Pending], _Lost | None]:
        """Up to max_events queued events, up to and including the first run of lost ones
        (under the lock)."""
        events: list[_Pending] = []
        while self._queue and len(events) < max_events:
            entry = self._queue.popleft()
            if isinstance(entry, _Lost):
                self._lost_queued -= 1
                return events, entry
            events.append(entry)
        return events, None

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._bus.unsubscribe(self)


class EventBus:
    """The sidecar's subscribers and registered pools. Thread-safe; publishing with no
    subscriber costs one check.

    A pool comes and goes (pool_registered / pool_unregistered) under the lock a subscription
    starts and takes its snapshot under, so each pool is either in a subscriber's snapshot or
    announced to it live afterwards, once, and never in a snapshot after it is gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _subs and _pools
        self._subs: tuple[Subscription, ...] = ()
        self._pools: dict[EventPool, HostKeys] = {}  # registered and not unregistered yet

    def subscribe(
        self, namespace: str | None = None, max_queued_keys: int = MAX_QUEUED_KEYS, *, snapshot: bool = False
    ) -> Subscription:
        """Events of pools in `namespace` (None: every namespace) from now on. With snapshot,
        the subscription starts with POOL_REGISTERED and STORED(host, every resident key) of
        each such pool registered now, each pool's taken under its index's lock, so that
        snapshot and later events agree."""
        sub = Subscription(self, namespace, max_queued_keys)
        with self._lock:
            self._subs = (*self._subs, sub)
            if snapshot:
                for pool, host_keys in self._pools.items():
                    if sub.matches(pool):
                        host_keys(functools.partial(_snapshot, sub, pool))
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def pool_registered(self, pool: EventPool, host_keys: HostKeys) -> None:
        """Announce a new pool; snapshots include it from now on."""
        with self._lock:
            self._pools[pool] = host_keys
            self.publish(EventKind.POOL_REGISTERED, pool)

    def pool_unregistered(self, pool: EventPool) -> None:
        """Announce that the pool is gone; snapshots leave it out from now on."""
        with self._lock:
            self._pools.pop(pool, None)
            self.publish(EventKind.POOL_UNREGISTERED, pool)

    def publish(self, kind: EventKind, pool: EventPool, tier: Tier = Tier.NONE, keys: Iterable[bytes] = ()) -> None:
        subs = self._subs  # a tuple replaced on change: read without the lock
        if not subs:
            return
        listed = list(keys)
        if kind in (EventKind.STORED, EventKind.REMOVED) and not listed:
            return
        for sub in subs:
            if sub.matches(pool):
                sub.offer(kind, pool, tier, listed)

    def close(self) -> None:
        for sub in self._subs:
            sub.close()


class PoolEvents:
    """What one pool publishes: the callbacks its host index and storage tier call."""

    def __init__(self, bus: EventBus, pool: EventPool):
        self.bus, self.pool = bus, pool

    def host(self, change: str, keys: list[bytes]) -> None:
        """HostIndex observer (every bind, under the cache lock): change is "stored" or "removed"."""
        if self.bus.subscribers:  # nobody listening: one length check on the offload path
            self.bus.publish(EventKind(change), self.pool, Tier.HOST, keys)

    def storage(self, change: str, keys: list[bytes]) -> None:
        """StorageTier watcher: change is "stored" or "removed"."""
        if self.bus.subscribers:
            self.bus.publish(EventKind(change), self.pool, Tier.STORAGE, keys)

    def registered(self, host_keys: HostKeys) -> None:
        """The pool is ready: announce it, and include it in snapshots (its keys from host_keys)."""
        self.bus.pool_registered(self.pool, host_keys)

    def unregistered(self) -> None:
        self.bus.pool_unregistered(self.pool)


def _snapshot(sub: Subscription, pool: EventPool, keys: list[bytes]) -> None:
    sub.offer(EventKind.POOL_REGISTERED, pool, Tier.NONE, [], snapshot=True)
    if keys:
        sub.offer(EventKind.STORED, pool, Tier.HOST, keys, snapshot=True)
