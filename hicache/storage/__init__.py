"""Storage tiers below the host pool: file (default), redis, none. No torch here."""

from hicache.storage.base import Buffer, Payload, StorageTier, TierHealth, TierIdentity, TierStats
from hicache.storage.factory import BACKENDS, make_tier
from hicache.storage.page_format import PageError

__all__ = [
    "BACKENDS",
    "Buffer",
    "PageError",
    "Payload",
    "StorageTier",
    "TierHealth",
    "TierIdentity",
    "TierStats",
    "make_tier",
]
