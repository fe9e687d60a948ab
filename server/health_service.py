"""gRPC's health service, with every open Watch stream ended at shutdown."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health


class HealthService(health.HealthServicer):
    """grpc's health service with end_watches(): on shutdown it ends every open Watch stream
    (after its last answer, NOT_SERVING), which would otherwise hold the server all its grace."""

    def __init__(self) -> None:
        super().__init__()
        self._watches_lock = threading.Lock()
        self._watches: set[Callable[[], None]] = set()
        self._ending = False

    def Watch(self, request: Any, context: grpc.ServicerContext, send_response_callback: Any = None) -> Any:
        stream = super().Watch(request, context, send_response_callback)
        # the blocking form returns its stream; the other one ends when sent None
        end = stream.close if stream is not None else functools.partial(send_response_callback, None)
        with self._watches_lock:
            if not self._ending:
                self._watches.add(end)
                context.add_callback(functools.partial(self._forget, end))
                return stream
        end()  # a Watch that came while shutting down
        return stream

    def _forget(self, end: Callable[[], None]) -> None:
        with self._watches_lock:
            self._watches.discard(end)

    def end_watches(self) -> None:
        with self._watches_lock:
            self._ending = True
            ends, self._watches = list(self._watches), set()
        for end in ends:
            end()
