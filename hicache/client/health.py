"""Ask a sidecar's grpc.health.v1 service how it is: what `hicache health` and the
container HEALTHCHECK run, and what the demo waits on before it starts the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hicache.client.tls import ClientTls

SERVING = "SERVING"


def grpc_target(target: str) -> str:
    """A gRPC target from a socket path or a target. A path is what starts with "/" or ".",
    or has no ":" ("/run/x.sock", "./x.sock", "x.sock" -> "unix:///abs/x.sock"); anything
    else ("host:port", "unix:...", "dns:///...") is a gRPC target as given."""
    if not target:
        raise ValueError("target must be a socket path or a gRPC target, got ''")
    if target.startswith(("/", ".")) or ":" not in target:
        return f"unix://{os.path.abspath(target)}"
    return target


@dataclass(frozen=True)
class HealthAnswer:
    """status: the serving status name (SERVING, NOT_SERVING, SERVICE_UNKNOWN, UNKNOWN) when
    the call answered, else the gRPC status code name of the failed call (UNAVAILABLE,
    DEADLINE_EXCEEDED, UNKNOWN, ...): call_failed tells the two UNKNOWNs apart."""

    status: str
    call_failed: bool


def ask_health(target: str, *, service: str = "", timeout: float = 2.0, tls: ClientTls | None = None) -> HealthAnswer:
    """One health Check of `service` ('' is the whole server) on `target` (over TLS with `tls`:
    a --listen served with --tls-cert)."""
    address = grpc_target(target)
    channel = (
        grpc.insecure_channel(address)
        if tls is None
        else grpc.secure_channel(address, tls.credentials(), options=tls.options())
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return HealthAnswer(exc.code().name, call_failed=True)
        return HealthAnswer(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), call_failed=False)


def check_health(target: str, *, service: str = "", timeout: float = 2.0) -> str:
    """The serving status name (SERVING, NOT_SERVING, SERVICE_UNKNOWN, ...), or the gRPC
    status code name (UNAVAILABLE, DEADLINE_EXCEEDED, ...) when the call itself fails."""
    return ask_health(target, service=service, timeout=timeout).status
