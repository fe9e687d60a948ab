"""Validation of a call's keys and device pages, before anything changes."""

from __future__ import annotations

from collections.abc import Sequence

from hicache.transfer.plan import as_pages, small_int_pages


def check_keys(
    keys: Sequence[bytes], key_bytes: int, key_hash: str, max_batch: int, *, unique: bool = False
) -> list[bytes]:
    """Raises ValueError for more than max_batch keys, a key that is not `key_bytes` bytes,
    or (unique) a key given twice, naming the index and value."""
    if len(keys) > max_batch:
        raise ValueError(f"batch of {len(keys)} keys exceeds the limit of {max_batch}")
    out = []
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != key_bytes:
            shown = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
            raise ValueError(f"keys[{i}] must be a {key_bytes}-byte {key_hash} key, got {shown}")
        out.append(key)
    if unique and len(set(out)) != len(out):
        seen: dict[bytes, int] = {}
        for i, key in enumerate(out):
            if key in seen:
                raise ValueError(f"keys[{i}] repeats keys[{seen[key]}] ({key.hex()})")
            seen[key] = i
    return out


def check_pages(device_pages: Sequence[int], n: int, num_pages: int) -> list[int]:
    """Raises ValueError unless there are n pages, each in [0, num_pages) and unique."""
    if len(device_pages) != n:
        raise ValueError(f"got {n} keys but {len(device_pages)} device_pages")
    pages = list(device_pages)
    small = small_int_pages("device_pages", pages, num_pages)  # a call's few pages: no numpy
    return small if small is not None else [int(p) for p in as_pages("device_pages", pages, num_pages)]
