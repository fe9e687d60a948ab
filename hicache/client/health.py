"""Ask a sidecar's grpc.health.v1 service how it is: what `hicache health` and the
container HEALTHCHECK run, and what the demo waits on before it starts the engine."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = "SERVING"


def grpc_target(target: str) -> str:
    """A gRPC target from a socket path ("/run/x.sock" -> "unix:///run/x.sock") or a target."""
    if not target:
        raise ValueError("target must be a socket path or a gRPC target, got ''")
    return f"unix://{target}" if target.startswith("/") else target


def check_health(target: str, *, service: str = "", timeout: float = 2.0) -> str:
    """The serving status name (SERVING, NOT_SERVING, SERVICE_UNKNOWN, ...), or the gRPC
    status code name (UNAVAILABLE, DEADLINE_EXCEEDED, ...) when the call itself fails."""
    with grpc.insecure_channel(grpc_target(target)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
