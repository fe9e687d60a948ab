"""The control path's cache state: which key lives in which host page. No torch here."""

from hicache.cache.index import HostIndex

__all__ = ["HostIndex"]
