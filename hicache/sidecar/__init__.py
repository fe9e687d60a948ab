"""The sidecar's logic, callable without gRPC: HiCacheService and, per registered pool, the
mapped device pool, host pool, cache and transfers; operations, registration, leases and
request ids. server/ wraps it in a gRPC process."""

from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.errors import NoSpace, StateError, UnknownId
from hicache.sidecar.service import HiCacheService

__all__ = ["HiCacheService", "NoSpace", "ServiceConfig", "StateError", "UnknownId"]
