"""The client's connection to one sidecar: the channel, deadlines, retries with the same
request id, and the lease keep-alive thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc

from hicache.api import POOL_SECRET
from hicache.client.handles import HiCacheRpcError
from hicache.client.health import grpc_target  # a socket path, relative too, or a gRPC target
from hicache.client.tls import ClientTls
from hicache.rpc.generated import hicache_pb2 as pb
from hicache.rpc.generated import hicache_pb2_grpc as pb_grpc

T = TypeVar("T")


class Connection:
    """Thread-safe. `stub` is the hicache.v1.HiCache stub; `metadata` carries the token."""

    def __init__(self, target: str, token: str | None, *, timeout: float, retries: int, tls: ClientTls | None):
        self.target = grpc_target(target)
        self.timeout = timeout
        self.retries = retries
        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            # a restarted sidecar is found again within a second, not after a long backoff
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if tls is None:
            self._channel = grpc.insecure_channel(self.target, options=options)
        else:
            self._channel = grpc.secure_channel(self.target, tls.credentials(), options=options + tls.options())
        self.stub = pb_grpc.HiCacheStub(self._channel)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None
        self._lease_s = 0.0  # the lease keep_alive renews within (the latest registration's)
        self._wake = threading.Event()  # the renew thread's: stop, or a new lease

    def call(
        self,
        method: Callable[..., T],
        request: Any,
        *,
        retry: bool = True,
        wait: bool = False,
        extra: tuple[tuple[str, str], ...] = (),
        timeout: float | None = None,
    ) -> T:
        """One call with the deadline. `wait`: wait (up to the deadline) for a sidecar that is
        not up yet, for the first contact; otherwise a sidecar that is down fails the call at
        once with UNAVAILABLE, so an engine never stalls a forward pass on a dead cache.
        `retry`: an UNAVAILABLE call is retried (same request id) `retries` times, all the
        attempts within the one deadline. `extra`: more metadata (a pool's secret).
        `timeout`: the deadline in s, if not the connection's. Raises HiCacheRpcError."""
        # Kept by hand rather than gRPC's service-config retryPolicy: the policy retries inside
        # the channel where this loop can log nothing and cannot tell a first contact (wait)
        # from a call to a dead sidecar, which must fail at once; the request id makes either safe.
        attempts = 1 + (self.retries if retry else 0)
        metadata = self.metadata + extra
        deadline = self.timeout if timeout is None else timeout
        end = time.monotonic() + deadline
        for attempt in range(attempts):
            left = end - time.monotonic()
            if left <= 0:  # the retries used it up: one deadline for the call, not one per attempt
                raise HiCacheRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {deadline:g} s ({attempt} attempts)"
                )
            try:
                return method(request, timeout=left, metadata=metadata, wait_for_ready=wait)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code == grpc.StatusCode.CANCELLED:
                    # never this side's doing (no call here is cancelled): gRPC's server drops
                    # a call that reaches it as it stops, so the sidecar is going away
                    code, details = grpc.StatusCode.UNAVAILABLE, f"the sidecar dropped the call ({details})"
                if code == grpc.StatusCode.UNAVAILABLE and attempt + 1 < attempts:
                    time.sleep(max(0.0, min(end - time.monotonic(), 0.02 * 2**attempt)))
                    continue  # same request id: the sidecar answers a retry idempotently
                raise HiCacheRpcError(code, details) from None
        raise AssertionError("unreachable")

    def keep_alive(self, pools: Callable[[], Iterable[tuple[str, str]]], lease_s: float) -> None:
        """Start (once) a thread that renews the leases of pools() ((pool id, secret) pairs)
        every lease_s / 3, where lease_s is the one the latest registration was given (a
        restarted sidecar may lease for less)."""
        if lease_s != self._lease_s:
            self._lease_s = lease_s
            if self._keepalive is not None:
                self._wake.set()  # a thread sleeping out the old period renews now, then by the new one
        if self._keepalive is not None:
            return

        def renew() -> None:
            while True:
                self._wake.wait(max(0.05, self._lease_s / 3))
                if self._stop.is_set():
                    return
                self._wake.clear()
                for pool_id, secret in list(pools()):
                    try:
                        self.stub.KeepAlive(
                            pb.KeepAliveRequest(pool_id=pool_id),
                            timeout=self.timeout,
                            metadata=self.metadata + ((POOL_SECRET, secret),),
                        )
                    except grpc.RpcError:
                        pass  # the next call reports the problem
                    except ValueError:  # the channel was closed meanwhile (close())
                        return

        self._keepalive = threading.Thread(target=renew, daemon=True, name="hicache-keepalive")
        self._keepalive.start()

    def stop_keep_alive(self) -> None:
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        self.stop_keep_alive()
        self._channel.close()
