"""Registering the HiCache servicer so that a request that does not decode gets INVALID_ARGUMENT.

grpcio answers a request its deserializer rejects (bad wire format, a `string` field that
is not UTF-8) with INTERNAL "Exception deserializing request!", which tells the caller
nothing and looks like a sidecar bug. Here every method receives the raw bytes and decodes
them itself; a failure is the caller's mistake: INVALID_ARGUMENT naming the method and why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from hicache.rpc.generated import hicache_pb2_grpc as pb_grpc


class _Capture:
    """Stands in for a grpc.Server to collect the generated method handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_servicer(servicer: pb_grpc.HiCacheServicer, server: grpc.Server) -> None:
    """Like pb_grpc.add_HiCacheServicer_to_server, with the request decoding checked."""
    capture = _Capture()
    pb_grpc.add_HiCacheServicer_to_server(servicer, capture)
    handlers = {name: _checked(name, h) for name, h in capture.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)


def _checked(name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    decode: Callable[[bytes], Any] = handler.request_deserializer

    def parse(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return decode(raw)
        except Exception as exc:  # DecodeError, or UnicodeDecodeError for a non-UTF-8 string field
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{name}: the request does not decode ({len(raw)} bytes): {type(exc).__name__}: {exc}",
            )

    if handler.unary_unary is not None:
        call = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda raw, context: call(parse(raw, context), context),
            response_serializer=handler.response_serializer,
        )
    assert handler.unary_stream is not None, f"{name}: only unary requests are expected"
    stream = handler.unary_stream
    return grpc.unary_stream_rpc_method_handler(
        lambda raw, context: stream(parse(raw, context), context),
        response_serializer=handler.response_serializer,
    )
