"""Idempotent retries: a bounded memory of recent request ids and their answers.

An answer is keyed by (scope, request id) and checked against the call's arguments, not
against the caller: the servicer knows no caller identity that survives a reconnect, and a
retry after UNAVAILABLE may come on a new connection. So a caller that reuses another's
request id with the same arguments gets the other's answer; clients choose random ids
(HiCacheClient: uuid4) for that reason. An answer that names something since released is
dropped with forget(), so that it is never handed out stale.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
MAX_REQUEST_ID = 128


def fingerprint(*parts: Any) -> str:
    """A digest of a call's arguments, to tell a true retry from a reused id. One hash over
    a tagged encoding (a prefix code, so two argument lists never encode alike)."""
    h = hashlib.sha256()
    _feed(h, parts)
    return h.hexdigest()


def _feed(h: Any, parts: Sequence[Any]) -> None:
    for part in parts:
        if isinstance(part, bytes):
            h.update(b"b" + len(part).to_bytes(4, "little") + part)
        elif isinstance(part, list | tuple):
            h.update(b"[")
            _feed(h, part)
            h.update(b"]")
        else:
            h.update(b"r" + repr(part).encode() + b"\x00")


class _Slot:
    __slots__ = ("digest", "done", "ok", "result")

    def __init__(self, digest: str):
        self.digest = digest
        self.done = threading.Event()
        self.ok = False
        self.result: Any = None


class RequestCache:
    """Maps (scope, request id) to the first successful answer, keeping the newest `capacity`.

    A retry with the same id and arguments gets the stored answer; a concurrent retry waits
    for the first attempt. A failed attempt stores nothing (failures change no state), so a
    retry runs again. Raises ValueError for an empty or overlong id, or an id reused with
    different arguments.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._slots: OrderedDict[tuple[str, str, str], _Slot] = OrderedDict()

    def __len__(self) -> int:
        return len(self._slots)

    def run(self, scope: tuple[str, str], request_id: str, digest: str, fn: Callable[[], T]) -> T:
        """fn() once per (scope, request_id); scope is (method, pool id)."""
        if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID:
            raise ValueError(
                f"request_id must be a non-empty str of at most {MAX_REQUEST_ID} chars, got {request_id!r}"
            )
        key = (*scope, request_id)
        while True:
            with self._lock:
                slot = self._slots.get(key)
                if slot is None:
                    slot = self._slots[key] = _Slot(digest)
                    mine = True
                else:
                    mine = False
                    if slot.digest != digest:
                        raise ValueError(f"request_id {request_id!r} was already used for a different {scope[0]} call")
            if mine:
                break
            slot.done.wait()
            if slot.ok:
                return slot.result  # type: ignore[no-any-return]
            # the first attempt failed and was forgotten: try again as the owner
        try:
            result = fn()
        except BaseException:
            with self._lock:
                if self._slots.get(key) is slot:
                    del self._slots[key]
            slot.done.set()
            raise
        slot.result, slot.ok = result, True
        slot.done.set()
        with self._lock:
            self._trim_locked()
        return result

    def forget(self, scope: tuple[str, str], match: Callable[[Any], bool]) -> int:
        """Drop the finished answers in `scope` for which match(answer) is true (a later call
        with one of their ids runs anew); returns how many. Attempts still running stay."""
        with self._lock:
            victims = [
                key
                for key, slot in self._slots.items()
                if key[:2] == scope and slot.done.is_set() and slot.ok and match(slot.result)
            ]
            for key in victims:
                del self._slots[key]
        return len(victims)

    def _trim_locked(self) -> None:
        """Forget the oldest finished answers beyond capacity. Attempts still running stay
        (a retry of one must wait for it, not run it again), so the cache can exceed its
        capacity by the calls in flight."""
        excess = len(self._slots) - self.capacity
        if excess <= 0:
            return
        victims: list[tuple[str, str, str]] = []
        for key, slot in self._slots.items():
            if len(victims) == excess:
                break
            if slot.done.is_set():
                victims.append(key)
        for key in victims:
            del self._slots[key]
