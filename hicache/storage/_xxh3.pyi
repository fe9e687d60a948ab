# Stub for the C extension built from _xxh3.c (optional: page_format falls back to python-xxhash).
from collections.abc import Sequence

from hicache.storage.base import Buffer

def xxh3_64_long(parts: Sequence[Buffer]) -> int | None: ...
def set_scalar(flag: bool) -> bool: ...
