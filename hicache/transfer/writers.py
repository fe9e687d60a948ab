"""The single-writer rule: at most one unfinished transfer writes any given page."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

Done = Callable[[], bool]


class _Claim:
    """A blocking transfer's hold on its pages: its done() turns True when the block ends.
    (A plain class: cheaper than a generator context manager on every small transfer.)"""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = False

    def __call__(self) -> bool:
        return self.value

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.value = True


class WriterRegistry:
    """Destination pages of unfinished transfers, per pool ("device_pages" or "host_pages").

    A claim that overlaps an unfinished transfer's pages raises ValueError naming the pages,
    and registers nothing. Entries leave the registry once their `done()` returns True.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: list[tuple[str, frozenset[int], Done]] = []

    def _check(self, pool: str, pages: np.ndarray) -> frozenset[int]:
        if self._active:
            self._active = [entry for entry in self._active if not entry[2]()]
        wanted = frozenset(pages.tolist())
        for other_pool, other_pages, _ in self._active:
            clash = wanted & other_pages if other_pool == pool else frozenset()
            if clash:
                shown = sorted(clash)[:16]
                raise ValueError(
                    f"{pool} {shown}{' ...' if len(clash) > 16 else ''} are the destination of an unfinished "
                    f"transfer; wait for it before writing them again"
                )
        return wanted

    def check(self, pool: str, pages: np.ndarray) -> None:
        """Raise ValueError if `pages` overlap an unfinished transfer's; registers nothing."""
        with self._lock:
            self._check(pool, pages)

    def claim(self, pool: str, pages: np.ndarray) -> _Claim:
        """Hold `pages` of `pool` for the duration of a `with` block (a blocking transfer);
        raises ValueError, holding nothing, if an unfinished transfer writes one of them."""
        finished = _Claim()
        with self._lock:
            wanted = self._check(pool, pages)
            self._active.append((pool, wanted, finished))
        return finished

    @contextmanager
    def reserve(self, pool: str, pages: np.ndarray) -> Iterator[Callable[[Done], None]]:
        """Check `pages`, then let the block start the transfer and register its done().

        The registry stays locked for the block, so no other claim can slip in between.
        """
        with self._lock:
            wanted = self._check(pool, pages)
            yield lambda done: self._active.append((pool, wanted, done))

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's unfinished transfers do not run here (their pages
        hold what was copied by the fork) and would never be done, and the lock may have
        been held by a thread that was not copied; start empty."""
        self._lock = threading.Lock()
        self._active = []

    def active(self) -> list[tuple[str, frozenset[int]]]:
        """The (pool, pages) of unfinished transfers."""
        with self._lock:
            self._active = [entry for entry in self._active if not entry[2]()]
            return [(pool, pages) for pool, pages, _ in self._active]
