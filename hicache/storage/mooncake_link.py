"""How the Mooncake tier reaches a Mooncake Store cluster: one client per process and set of
options (MooncakeLink), shared by every tier on it, so that a sidecar lends the cluster one
global segment however many pools it has.

Mooncake's calls wait about 4 s for a master that went away, and its set-up retries an
absent master for about 90 s holding the GIL. So the link connects only after the master's
RPC port answers (mooncake_options.master_problem), and once a call reports the master
gone (RPC_FAIL) it is backed off: until the backoff runs out, calls return at once without
touching Mooncake, and after it a probe (the port, and the client's own health_check) lets
calls through again. A master restarted empty is served again once the client has mounted
its segment there (Mooncake does that itself); its pages are misses until written again.
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hicache.storage.base import TierHealth
from hicache.storage.mooncake_options import MooncakeOptions, master_problem
from hicache.storage.redis_link import Backoff

# Mooncake's error codes that the tier acts on (mooncake-store's ErrorCode)
NO_AVAILABLE_HANDLE = -200  # no segment has room (or none is mounted yet after a restart)
INVALID_PARAMS = -600  # among others: the object is longer than the buffers given
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800  # among others: the object is shorter than the buffers given
RPC_FAIL = -900  # the master did not answer

T = TypeVar("T")


class _PyBuffer(ctypes.Structure):  # CPython's Py_buffer, to read a buffer's address
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
PYBUF_SIMPLE = 0  # a contiguous buffer, as its exporter has it


def address(view: object) -> int:
    """The address of a contiguous buffer's first byte (read-only ones too). Raises
    BufferError for a non-contiguous one."""
    buffer = _PyBuffer()
    _get_buffer(view, ctypes.byref(buffer), PYBUF_SIMPLE)  # BufferError for a non-contiguous one
    try:
        return int(buffer.buf or 0)
    finally:
        _release_buffer(ctypes.byref(buffer))


class MooncakeLink:
    """A Mooncake Store client for `options`, connected now if the master answers, else on
    a later call or health() once it does. Thread-safe. Use open_link / release."""

    def __init__(self, options: MooncakeOptions, clock: Callable[[], float] = time.monotonic):
        self.options = options
        self._backoff = Backoff(options.backoff_initial_s, options.backoff_max_s, clock)
        self._store: Any = None
        self._connecting = threading.Lock()
        self._registered: set[tuple[int, int]] = set()  # (address, size) of buffers registered with the client
        self.why = ""  # why the cluster is down, while it is
        self.users = 0  # tiers holding the link (open_link / release)
        self.closed = False
        self._connect()

    @property
    def master(self) -> str:
        return self.options.master_server_address

    def _connect(self) -> Any:
        """The client, set up now unless the master does not answer (then backed off); None
        while another thread connects or the master is down."""
        if not self._connecting.acquire(blocking=False):
            return None
        try:
            if self._store is not None or self.closed:
                return self._store
            problem = master_problem(self.options)
            if problem:
                return self._down(problem)
            from mooncake.store import MooncakeDistributedStore

            host = self.options.hostname()
            # Mooncake's transfer listener binds this address, not every interface
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
            store = MooncakeDistributedStore()
            o = self.options
            rc = store.setup(
                host,
                o.metadata_server,
                o.global_segment_size,
                o.local_buffer_size,
                o.protocol,
                o.device_name,
                o.master_server_address,
            )
            if rc != 0:
                return self._down(f"mooncake setup against master {self.master} failed (code {rc})")
            self._store = store
            self._backoff.ok()
            self.why = ""
            return store
        finally:
            self._connecting.release()

    def _down(self, why: str) -> None:
        self.why = why
        self._backoff.failed()

    def ready(self) -> Any:
        """The client when calls may go to it now, else None (closed, down and backed off, or
        not connected). Once a backoff runs out, the master is probed before calls go through."""
        store = self._store
        if self.closed or self._backoff.blocked():
            return None
        if store is None:
            return self._connect()
        if self._backoff.due():
            problem = master_problem(self.options)
            if problem or store.health_check() != 0:
                return self._down(problem or f"mooncake master {self.master} does not answer the client's pings")
            self._backoff.ok()
        return store

    def run(self, call: Callable[[Any], T]) -> T | None:
        """call(client), or None at once while the cluster is down. A result that holds
        RPC_FAIL (an int, or a list of ints) backs the link off."""
        store = self.ready()
        if store is None:
            return None
        result = call(store)
        codes = result if isinstance(result, list) else [result]
        if RPC_FAIL in codes:
            self._down(f"mooncake master {self.master} did not answer (RPC_FAIL)")
        else:
            self._backoff.ok()
        return result

    def health(self) -> TierHealth:
        store = self.ready()
        if store is None:
            retry = self._backoff.retry_in()
            return TierHealth(False, f"{self.why or 'mooncake: connecting'}; retrying in {retry:.1f}s")
        code = store.health_check()
        if code != 0:
            self._down(f"mooncake master {self.master} does not answer the client's pings (health_check {code})")
            return TierHealth(False, self.why)
        return TierHealth(True, f"mooncake master {self.master}")

    def register(self, buffer: mmap.mmap, store: Any) -> None:
        """Register `buffer` with the client `store` (what an RDMA transfer may read and
        write) unless it is already. Called inside a run() call, where the client is known."""
        key = (address(buffer), len(buffer))
        if key not in self._registered and store.register_buffer(*key) == 0:
            self._registered.add(key)

    def forget(self, key: tuple[int, int]) -> None:
        """Unregister the buffer (address, size) registered earlier, if it is (its memory is
        about to be freed: a staging buffer replaced, or dropped with its thread or tier)."""
        store = self._store
        if key in self._registered:
            self._registered.discard(key)
            if store is not None:
                store.unregister_buffer(key[0])

    def close(self) -> None:
        """Close the client: it unmounts the segment this process lends, and the objects in it
        are gone for the whole cluster. Mooncake's close (and its destructor) holds the GIL,
        about 2 s with the master up and 12-15 s with it down, so with the master unreachable
        the client is kept unclosed instead (until the process ends)."""
        self.closed = True
        store, self._store = self._store, None
        if store is None:
            return
        if master_problem(self.options):
            _UNCLOSED.append(store)
        else:
            store.close()


_UNCLOSED: list[Any] = []  # clients whose master was gone when they closed: see MooncakeLink.close


_LINKS: dict[MooncakeOptions, MooncakeLink] = {}
_LINKS_LOCK = threading.Lock()


def open_link(options: MooncakeOptions, clock: Callable[[], float] = time.monotonic) -> MooncakeLink:
    """The process's link for `options` (made, and connected if it can be, on first use).
    Raises ImportError when the mooncake package is missing."""
    import mooncake.store  # noqa: F401 - fail here, in one line, without the package

    with _LINKS_LOCK:
        link = _LINKS.get(options)
        if link is None:
            link = _LINKS[options] = MooncakeLink(options, clock)
        link.users += 1
        return link


def release(link: MooncakeLink) -> None:
    """A tier is done with `link`. The link stays open with no tier on it: its client lends
    the cluster a segment that holds pages of other sidecars too, so it lives as long as the
    process (close_links at exit), and a pool that registers later uses it again."""
    with _LINKS_LOCK:
        link.users -= 1


@atexit.register
def close_links(master: str = "") -> None:
    """Close the links no tier uses (those to `master` only, when given): at exit, and in
    tests once a test's master is gone."""
    with _LINKS_LOCK:
        idle = [k for k, link in _LINKS.items() if link.users <= 0 and master in ("", k.master_server_address)]
        links = [_LINKS.pop(k) for k in idle]
    for link in links:
        link.close()
