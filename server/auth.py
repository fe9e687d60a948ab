"""Shared-token authentication: `authorization: Bearer <token>` in call metadata."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects every call but health checks with UNAUTHENTICATED unless it carries the token
    (a method the server does not have is UNIMPLEMENTED, token or not)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # no such method: UNIMPLEMENTED, as without a token
            return None
        message = "missing token" if not given else "wrong token"

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{message} for {handler_call_details.method}")

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
