"""StreamSlots: how many RPC threads long streams may hold at once.

The server runs each call on one of its --workers threads, and a streaming call (SubscribeEvents,
an operation's Watch) keeps its thread until the stream ends. Left alone, as many streams as
workers would starve every unary call, health checks included. So KV-event streams may hold
half of the workers, and the streams of both kinds together all but a quarter of them (at
least one); one more is refused (RESOURCE_EXHAUSTED) with refusal()'s message. Event
subscribers therefore never take the threads that reloads' Watch streams need, and unary calls
always have threads. (The health service's Watch runs without holding a thread.)"""

from __future__ import annotations

import threading


class StreamSlots:
    def __init__(self, total: int, events: int):
        if not 1 <= events <= total:
            raise ValueError(f"stream slots need 1 <= events <= total, got events {events} and total {total}")
        self.total, self.events = total, events
        self._any = threading.Semaphore(total)
        self._events = threading.Semaphore(events)

    def take(self, *, events: bool) -> bool:
        """Take a slot for a stream about to start (a KV-event stream if `events`); False when
        none is left for it."""
        if events and not self._events.acquire(blocking=False):
            return False
        if self._any.acquire(blocking=False):
            return True
        if events:
            self._events.release()
        return False

    def give_back(self, *, events: bool) -> None:
        """The stream that took a slot has ended."""
        self._any.release()
        if events:
            self._events.release()

    def refusal(self, what: str) -> str:
        return (
            f"{what}: this sidecar serves at most {self.events} KV-event streams and {self.total} streams in "
            f"all (KV events and Watch) at once, each holding one of its --workers RPC threads, and they are "
            f"open: close one, or start the sidecar with more --workers"
        )
