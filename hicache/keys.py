"""Page keys: chained hashes of (previous page key, the page's token ids, namespace).

key[i] = H(len(ns) | ns | key[i-1] | token ids of page i as little-endian int64), with
key[-1] = `parent` (b"" at the start of a sequence). H is SHA-256 (32-byte keys) or,
when the `xxhash` package is installed and chosen, XXH3-128 (16-byte keys). Only full
pages get a key. Because every key folds in the one before it, equal keys mean equal
prefixes, and the namespace (tenant, cache salt) separates tenants on every tier.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from hicache.validate import is_int

HashName = Literal["sha256", "xxh128"]
KEY_BYTES: dict[str, int] = {"sha256": 32, "xxh128": 16}


def available_hashes() -> tuple[str, ...]:
    """The hash names this process can compute."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return ("sha256",)
    return ("sha256", "xxh128")


def _hasher(name: str) -> Callable[[bytes], bytes]:
    if name == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if name == "xxh128":
        try:
            import xxhash
        except ImportError:
            raise ValueError("key hash 'xxh128' needs the xxhash package") from None
        return lambda data: xxhash.xxh3_128_digest(data)
    raise ValueError(f"unknown key hash {name!r}; expected one of {list(KEY_BYTES)}")


def page_keys(
    token_ids: Sequence[int] | np.ndarray,
    page_size: int,
    namespace: str = "",
    parent: bytes | None = None,
    hash_name: HashName = "sha256",
) -> list[bytes]:
    """One key per full page of `token_ids`; a trailing partial page gets none.

    `parent` is the key of the page before token_ids[0] (None at a sequence start).
    Raises ValueError for page_size < 1, a non-str namespace, a malformed parent or
    negative / non-integer token ids.
    """
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if not isinstance(namespace, str):
        raise ValueError(f"namespace must be a str, got {type(namespace).__name__}")
    digest = _hasher(hash_name)
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES[hash_name]):
        raise ValueError(f"parent must be a {KEY_BYTES[hash_name]}-byte {hash_name} key, got {parent!r}")
    tokens = np.asarray(token_ids)
    if tokens.size and (tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or tokens.min() < 0):
        raise ValueError(f"token_ids must be a 1-D list of non-negative ints, got {tokens.dtype} {tokens.shape}")
    ns = namespace.encode("utf-8")
    prefix = struct.pack("<I", len(ns)) + ns
    tokens = tokens.astype("<i8", copy=False)
    keys: list[bytes] = []
    prev = parent or b""
    for start in range(0, tokens.size - page_size + 1, page_size):
        prev = digest(prefix + prev + tokens[start : start + page_size].tobytes())
        keys.append(prev)
    return keys
