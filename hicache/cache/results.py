"""What HierarchicalCache needs of a host pool, and what its reserve() and load() answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from hicache.geometry import KVGeometry
from hicache.storage.base import Buffer

Tier = Literal["host", "storage", "none"]


class PagePool(Protocol):
    """What the cache needs of a host pool (HostKVPool has it)."""

    geometry: KVGeometry

    @property
    def num_pages(self) -> int: ...
    def read_page(self, page: int) -> Any: ...  # a uint8 tensor (or buffer) of page_bytes
    def write_page(self, page: int, data: Buffer) -> None: ...
    def page_pieces(self, page: int) -> list[memoryview] | None: ...  # writable views in page order, or None


@dataclass(frozen=True)
class Reservation:
    """reserve()'s answer: copy the `new` keys' data into their host pages, then commit()."""

    new: list[tuple[bytes, int]]
    existing: list[tuple[bytes, int]]  # already on host: nothing to copy
    pending: list[bytes]  # being filled by another offload or a prefetch: nothing to copy
    refused: list[bytes] = field(default_factory=list)  # reserve(partial=True): no room left
    owner: object = field(default_factory=object, repr=False, compare=False)  # its mark in _pending


@dataclass(frozen=True)
class LoadResult:
    """load()'s answer: the leading keys now on host, referenced until release(keys)."""

    keys: list[bytes]
    pages: list[int]
    sources: list[Tier]  # "host", or "storage" for a key fetched from storage first
