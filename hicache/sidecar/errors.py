"""The sidecar's errors.

Error policy (the servicer maps these to gRPC status codes, nothing else does):
- ValueError: a caller's mistake (bad page, key, geometry, batch size), naming the value.
- UnknownId (a KeyError): an unknown pool id or operation id.
- StateError: the call is well formed but the pool cannot take it now (closing, shut down).
- NoSpace: returned, not raised, when a whole call cannot proceed for lack of memory.
- QuotaExceeded: a call that would take a pool past its share of something shared (pins).
"""

from __future__ import annotations

from dataclasses import dataclass


class StateError(RuntimeError):
    """The pool or service is in a state that refuses the call (closing, shut down)."""


class QuotaExceeded(Exception):
    """A call that would take a pool past its share (RESOURCE_EXHAUSTED over gRPC); the
    message names the flag that sets the share. Nothing was changed."""


class UnknownId(KeyError):
    """A pool id or operation id the sidecar does not know (NOT_FOUND over gRPC; any other
    KeyError is an internal error)."""


@dataclass(frozen=True)
class NoSpace:
    """A whole call could not proceed for lack of memory or pool slots."""

    reason: str
