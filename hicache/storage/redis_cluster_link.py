"""ClusterLink: the Redis tier over a Redis (or Valkey) Cluster.

A batch is split by each key's slot into one non-transactional pipeline per master, and the
pipelines run in parallel. Keys carry no hash tag, so a model's pages spread over all slots.
A MOVED or ASK reply (resharding, failover) is followed once, to the node it names (ASK with
ASKING before the command), and a MOVED also refreshes the slot map. A node that does not
answer is backed off on its own, its commands fail (misses, failed writes) at once, and the
slot map is refreshed, so that a replica that took over is found. Nothing here raises on
the data path; pages are verified by the tier above, so a redirect can cost a miss, never
a wrong page. The client, the slot map, each node's backoff and the cluster's health are in
redis_cluster_topology.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from typing import Any

from hicache.storage.lazy_threads import LazyThreads
from hicache.storage.redis_cluster_topology import ClusterTopology
from hicache.storage.redis_link import Backoff, Command, command_key, down_errors, redis_errors
from hicache.storage.resp import Into, Wires


class ClusterLink(ClusterTopology):
    """The cluster that the startup nodes in `url` belong to. Connects lazily: an unreachable
    cluster makes the link unhealthy, not the constructor fail."""

    _all: weakref.WeakSet[ClusterLink] = weakref.WeakSet()

    def __init__(
        self,
        url: str | Sequence[str],
        timeout_s: float,
        make_backoff: Callable[[], Backoff],
        on_error: Callable[[str], None],
        clock: Callable[[], float],
    ):
        super().__init__(url, timeout_s, make_backoff, on_error, clock)
        self._down = down_errors()
        self._senders = LazyThreads(8, "hicache-redis-node")  # made again in a forked child
        self._node_wires: dict[str, Wires] = {}  # host:port -> connections of the data path
        ClusterLink._all.add(self)

    @classmethod
    def forget_after_fork(cls) -> None:
        """In a forked child: new locks (a parent thread may have held one at the fork), and
        no connection of the parent's: each node's are dropped without shutdown()."""
        for link in list(cls._all):
            link._lock, link._refreshing = threading.Lock(), threading.Lock()
            inherited, link._node_wires = list(link._node_wires.values()), {}
            for wires in inherited:
                wires.forget_inherited()

    # ---- the data path --------------------------------------------------------------------------
    def run(self, commands: Sequence[Command], into: Into | None = None) -> list[Any]:
        import redis
        from redis.crc import key_slot
        from redis.exceptions import AskError, MovedError

        if not commands:
            return []
        client = self._cluster()
        if client is None:
            why = "closed" if self._closed else "unreachable"
            return [redis.ConnectionError(f"redis cluster {self.url} {why}")] * len(commands)
        replies: list[Any] = [None] * len(commands)
        by_node: dict[str, tuple[Any, list[int]]] = {}
        stale = False
        for i, command in enumerate(commands):
            try:
                node = client.nodes_manager.get_node_from_slot(key_slot(command_key(command)))
            except redis_errors() as exc:  # a slot no master serves (SlotNotCoveredError, mid-failover)
                replies[i], stale = exc, True
                continue
            if self._blocked(node.name):
                replies[i], stale = redis.ConnectionError(f"redis node {node.name} is down"), True
                continue
            by_node.setdefault(node.name, (node, []))[1].append(i)
        stale |= self._send(client, by_node, commands, replies, asking=False, into=into)
        sent_to = {i: node for node, idx in by_node.values() for i in idx}
        # follow each redirect once: to the node named, after ASKING for an ASK
        redirected: dict[str, tuple[Any, list[int]]] = {}
        asked: dict[str, tuple[Any, list[int]]] = {}
        for i, reply in enumerate(replies):
            if isinstance(reply, AskError):
                # no host ("MOVED 3999 :7001", from a node with an unknown endpoint): the
                # host of the node that sent the redirect, as redis-py does
                host = reply.host or sent_to[i].host
                node = client.nodes_manager.get_node(host, reply.port) or _node(host, reply.port)
                (redirected if isinstance(reply, MovedError) else asked).setdefault(node.name, (node, []))[1].append(i)
                stale |= isinstance(reply, MovedError)
        if stale:
            self._refresh()
        self._send(client, redirected, commands, replies, asking=False, into=into)
        self._send(client, asked, commands, replies, asking=True, into=into)
        return replies

    def _send(
        self,
        client: Any,
        by_node: dict[str, tuple[Any, list[int]]],
        commands: Sequence[Command],
        replies: list[Any],
        *,
        asking: bool,
        into: Into | None,
    ) -> bool:
        """Run each node's commands as one pipeline, the nodes in parallel, writing the replies
        in place; True if a node did not answer (the slot map may be stale)."""
        jobs = [(node, idx) for node, idx in by_node.values()]
        if not jobs:
            return False

        def one(node: Any, idx: list[int]) -> bool:
            local = None if into is None else (lambda j, size: into(idx[j], size))
            out = self._pipeline(client, node, [commands[i] for i in idx], asking, local)
            for i, reply in zip(idx, out, strict=True):
                replies[i] = reply
            return any(isinstance(r, self._down) for r in out)

        if len(jobs) == 1 or self._closed:  # closed: no sender threads are made again
            return any([one(node, idx) for node, idx in jobs])
        senders = self._senders.get()
        futures = [senders.submit(one, node, idx) for node, idx in jobs]
        wait(futures)  # every node done before returning: replies land in the caller's buffers
        return any([f.result() for f in futures])

    def _wires(self, client: Any, node: Any) -> Wires:
        """The connections to `node`, made by its redis-py client (remade if that changed).
        Raises redis.ConnectionError once the link is closed (close() would not see new ones)."""
        import redis

        conn = node.redis_connection or client.get_redis_connection(node)
        with self._lock:
            if self._closed:
                raise redis.ConnectionError(f"redis cluster {self.url} closed")
            wires = self._node_wires.get(node.name)
            if wires is not None and wires.client is conn:
                return wires
            self._node_wires[node.name] = fresh = Wires(conn)
        if wires is not None:
            wires.close()
        return fresh

    def _pipeline(
        self, client: Any, node: Any, commands: list[Command], asking: bool, into: Into | None = None
    ) -> list[Any]:
        sent = [c for command in commands for c in (("ASKING",), command)] if asking else commands
        try:
            out = self._wires(client, node).execute(sent, _skip_asking(into) if asking and into else into)
        except redis_errors() as exc:
            if isinstance(exc, self._down):
                self._node_backoff(node.name).failed()
            self._on_error(f"redis node {node.name}: {type(exc).__name__}: {exc}")
            return [exc] * len(commands)
        with self._lock:
            backoff = self._nodes.get(node.name)
        if backoff is not None:
            backoff.ok()
        return out[1::2] if asking else out

    # ---- a down node's probe (health, in redis_cluster_topology), and close ---------------------
    def _probe(self, client: Any, name: str) -> None:
        host, port = name.rsplit(":", 1)
        node = client.nodes_manager.get_node(host, int(port)) or _node(host, int(port))
        self._pipeline(client, node, [("PING",)], asking=False)

    def close(self) -> None:
        with self._lock:  # first: a call in flight then makes no new threads or connections
            self._closed = True
        self._senders.close()
        with self._lock:
            client, self._client = self._client, None
            wires, self._node_wires = list(self._node_wires.values()), {}
        for w in wires:
            w.close()
        if client is not None:
            client.close()


def _skip_asking(into: Into) -> Into:
    """`into` for a pipeline that sends ASKING before each command."""

    def shifted(j: int, size: int) -> memoryview | None:
        return into(j // 2, size) if j % 2 else None

    return shifted


def _node(host: str, port: int) -> Any:
    """A ClusterNode the client does not know yet (a redirect's target before a refresh)."""
    from redis.cluster import ClusterNode

    return ClusterNode(host, port)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=ClusterLink.forget_after_fork)
