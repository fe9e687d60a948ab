"""StreamSlots: how many RPC threads long streams may hold at once.

The server runs each call on one of its --workers threads, and a streaming call (SubscribeEvents,
an operation's Watch, the health service's Watch) keeps its thread until the stream ends. Left
alone, as many streams as workers would starve every unary call, health checks included. So
all of them together may hold half of the workers; one more is refused (RESOURCE_EXHAUSTED)
with refusal()'s message, and the other half always serves unary calls."""

from __future__ import annotations

import threading


class StreamSlots:
    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"stream slots must be >= 1, got {limit}")
        self.limit = limit
        self._free = threading.Semaphore(limit)

    def take(self) -> bool:
        """Take a slot for a stream about to start; False when every slot is held."""
        return self._free.acquire(blocking=False)

    def give_back(self) -> None:
        """The stream that took a slot has ended."""
        self._free.release()

    def refusal(self, what: str) -> str:
        return (
            f"{what}: this sidecar serves at most {self.limit} streams at once (KV events, Watch and "
            f"health Watch together: half of its --workers), and they are open: close one, or "
            f"start the sidecar with more --workers"
        )
