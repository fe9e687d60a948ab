"""The null tier (backend "none"): stores nothing, every read is a miss."""

from __future__ import annotations

from hicache.storage import page_format as fmt
from hicache.storage.base import Payload, StorageTier, TierHealth, TierIdentity, TierStats


class NullTier(StorageTier):
    """No storage below the host pool. set() returns False; the hierarchy skips writes."""

    backend = "none"
    enabled = False

    def contains(self, key: bytes) -> bool:
        fmt.check_key(key)
        return False

    def get(self, key: bytes) -> memoryview | None:
        fmt.check_key(key)
        self._count(misses=1)
        return None

    def set(self, key: bytes, data: Payload) -> bool:
        fmt.encode_header(self.identity, key, data)  # same validation as a real tier
        return False

    def delete(self, key: bytes) -> bool:
        fmt.check_key(key)
        return False

    def health(self) -> TierHealth:
        return TierHealth(True, "no storage tier")

    def _fill_stats(self, snap: TierStats) -> None:
        snap.pages, snap.bytes = 0, 0


class DownTier(NullTier):
    """A configured tier that could not be made (its folder is read-only, say) under an
    optional storage tier: it stores nothing and reports itself down, so host memory serves
    and health, stats and metrics say why."""

    def __init__(self, identity: TierIdentity, backend: str, reason: str):
        super().__init__(identity)
        self.backend = backend
        self.reason = reason

    def health(self) -> TierHealth:
        return TierHealth(False, self.reason)
