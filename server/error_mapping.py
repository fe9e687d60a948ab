"""How a failed call is answered: the service's exceptions and the servicer's own refusals
(Exhausted, Forbidden) mapped to gRPC status codes (abort_for; the table is in
server.servicer's docstring), and mapped_errors, which wraps each of the servicer's unary methods
in that mapping and the shutdown drain."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc

from hicache.sidecar.errors import QuotaExceeded, StateError, UnknownId

log = logging.getLogger("hicache.server")
F = TypeVar("F", bound=Callable[..., Any])


class Exhausted(Exception):
    """A NoSpace answer, or no room for another stream: raised inside the servicer only to
    reach abort_for (RESOURCE_EXHAUSTED)."""


def abort_for(exc: BaseException, context: grpc.ServicerContext) -> NoReturn:
    """Abort the call with the status code of `exc` (see server.servicer's module docstring)."""
    if isinstance(exc, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, UnknownId):
        context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "not found")
    if isinstance(exc, StateError):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, Exhausted | QuotaExceeded):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, Forbidden):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
    log.exception("internal error", exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, "internal error: the sidecar's log has the details")
    raise AssertionError("context.abort raises")


def mapped_errors(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            with self.drain.call():  # once draining (shutdown): FAILED_PRECONDITION
                return method(self, request, context)
        except Exception as exc:
            abort_for(exc, context)

    return wrapper  # type: ignore[return-value]


class Forbidden(Exception):
    """A call naming a pool without its secret, or all pools without the admin token."""
