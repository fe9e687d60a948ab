"""A pool of threads made on first use, and made again in a forked child.

The file tier's readers, the Redis tier's checksum threads and the cluster link's per-node
senders use it: threads do not survive fork, so a child that reused its parent's pool would
queue its work forever.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor


class LazyThreads:
    """A pool of `count` threads made on first use, and made again in a forked child: threads
    do not survive fork, and the parent's pool would queue the child's work forever."""

    _all: weakref.WeakSet[LazyThreads] = weakref.WeakSet()

    def __init__(self, count: int, name: str):
        self.count = count
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0  # the process that made _pool
        LazyThreads._all.add(self)

    @classmethod
    def forget_after_fork(cls) -> None:
        """In a forked child: a parent thread may have held a lock at the fork; start afresh."""
        for threads in list(cls._all):
            threads._lock = threading.Lock()
            threads._pool = None

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.count, thread_name_prefix=self._name)
                self._pid = os.getpid()
            return self._pool

    def close(self) -> None:
        """Finish the queued work and stop the threads (this process's only). Idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=LazyThreads.forget_after_fork)
