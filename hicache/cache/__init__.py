"""The control path's cache state: which key lives in which host page, the hierarchy over
a storage tier, and its policies. No torch here."""

from hicache.cache.config import HiCacheConfig, parse_extra_config
from hicache.cache.index import HostIndex
from hicache.cache.policies import PREFETCH_POLICIES, WRITE_POLICIES, PrefetchTimeout
from hicache.cache.prefetch import PrefetchHandle, PrefetchResult, PrefetchStatus
from hicache.cache.results import LoadResult, Reservation
from hicache.cache.tiering import HierarchicalCache

__all__ = [
    "PREFETCH_POLICIES",
    "WRITE_POLICIES",
    "HiCacheConfig",
    "HierarchicalCache",
    "HostIndex",
    "LoadResult",
    "PrefetchHandle",
    "PrefetchResult",
    "PrefetchStatus",
    "PrefetchTimeout",
    "Reservation",
    "parse_extra_config",
]
