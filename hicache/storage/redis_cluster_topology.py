"""The Redis Cluster as ClusterLink sees it: its topology and the health that follows from it.

The redis-py cluster client is made lazily (backed off while no startup node answers), the
slot map is asked for again at most every REFRESH_EVERY_S, and each node that ever failed
has a backoff of its own. The cluster is healthy while every slot is served by a master
that is not down. ClusterTopology is the base of ClusterLink (redis_cluster_link), which
adds the data path.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from hicache.storage.base import TierHealth
from hicache.storage.redis_link import Backoff, redis_errors
from hicache.storage.redis_options import split_urls

REFRESH_EVERY_S = 0.25  # the most often the slot map is asked for again


class ClusterTopology(ABC):
    """The client, slot map and node backoffs of the cluster that the startup nodes in `url`
    belong to; nothing connects before the first call."""

    def __init__(
        self,
        url: str | Sequence[str],
        timeout_s: float,
        make_backoff: Callable[[], Backoff],
        on_error: Callable[[str], None],
        clock: Callable[[], float],
    ):
        self.urls = split_urls(url)
        self.url = ",".join(self.urls)
        self._timeout, self._make_backoff, self._on_error, self._clock = timeout_s, make_backoff, on_error, clock
        self._lock = threading.Lock()  # guards _client, _nodes, _node_wires, _refreshed_at
        self._client: Any = None
        self._closed = False  # close() ran: no client is made again
        self._connect_backoff = make_backoff()
        self._nodes: dict[str, Backoff] = {}  # host:port -> its health, for every node that ever failed
        self._refreshed_at = -REFRESH_EVERY_S
        self._refreshing = threading.Lock()

    # ---- topology -----------------------------------------------------------------------------
    def _cluster(self) -> Any:
        """The RedisCluster client, connecting first if needed (None while unreachable, and
        once closed)."""
        with self._lock:
            if self._client is not None or self._closed:
                return self._client
        if self._connect_backoff.blocked():
            return None
        from redis.cluster import ClusterNode, RedisCluster

        try:
            others = [ClusterNode(urlsplit(u).hostname, urlsplit(u).port or 6379) for u in self.urls[1:]]
            client = RedisCluster.from_url(
                self.urls[0],
                startup_nodes=others,
                socket_timeout=self._timeout,
                socket_connect_timeout=self._timeout,
                require_full_coverage=False,
            )
        except redis_errors() as exc:
            self._connect_backoff.failed()
            self._on_error(f"redis cluster {self.url}: {type(exc).__name__}: {exc}")
            return None
        self._connect_backoff.ok()
        with self._lock:
            if self._client is None and not self._closed:
                self._client, self._refreshed_at = client, self._clock()
            else:
                client.close()  # another thread's connected meanwhile, or close() ran
            return self._client

    def _refresh(self) -> None:
        """Ask for the slot map again, at most every REFRESH_EVERY_S, by one thread at a time."""
        with self._lock:
            client = self._client
            if client is None or self._clock() - self._refreshed_at < REFRESH_EVERY_S:
                return
            self._refreshed_at = self._clock()
        if not self._refreshing.acquire(blocking=False):
            return
        try:
            client.nodes_manager.initialize()
        except Exception as exc:  # noqa: BLE001 - a refresh that fails leaves the old map
            self._on_error(f"redis cluster {self.url}: slot map refresh failed: {type(exc).__name__}: {exc}")
        finally:
            self._refreshing.release()

    def _node_backoff(self, name: str) -> Backoff:
        with self._lock:
            if name not in self._nodes:
                self._nodes[name] = self._make_backoff()
            return self._nodes[name]

    def _blocked(self, name: str) -> bool:
        with self._lock:
            backoff = self._nodes.get(name)
        return backoff is not None and backoff.blocked()

    # ---- health -----------------------------------------------------------------------------
    def health(self) -> TierHealth:
        client = self._cluster()
        if client is None:
            if self._closed:
                return TierHealth(False, f"redis cluster {self.url} closed")
            return TierHealth(
                False, f"redis cluster {self.url} unreachable; retry in {self._connect_backoff.retry_in():.2f}s"
            )
        for name in self._due():
            self._probe(client, name)
        serving = self._masters(client)
        down = set(self.nodes_down())
        if down & serving or len(self._covered(client)) < 16384:
            self._refresh()  # a replica may have taken over since
            serving, covered = self._masters(client), self._covered(client)
            if down & serving or len(covered) < 16384:
                return TierHealth(
                    False,
                    f"redis cluster {self.url}: {16384 - len(covered)} slots unserved, "
                    f"masters down: {sorted(down & serving)}",
                )
        if down:
            return TierHealth(True, f"redis cluster: nodes down but their slots are served: {sorted(down)}")
        return TierHealth(True)

    def _due(self) -> list[str]:
        with self._lock:
            return [name for name, b in self._nodes.items() if b.due()]

    @abstractmethod
    def _probe(self, client: Any, name: str) -> None:
        """Try the down node `name` (host:port) once (ClusterLink: a PING), as its backoff allows."""

    @staticmethod
    def _masters(client: Any) -> set[str]:
        with client.nodes_manager._lock:
            return {nodes[0].name for nodes in client.nodes_manager.slots_cache.values() if nodes}

    @staticmethod
    def _covered(client: Any) -> list[int]:
        with client.nodes_manager._lock:
            return [slot for slot, nodes in client.nodes_manager.slots_cache.items() if nodes]

    def nodes_down(self) -> list[str]:
        if self._client is None and not self._connect_backoff.healthy:
            return list(self.urls)
        with self._lock:
            return sorted(name for name, b in self._nodes.items() if not b.healthy)
