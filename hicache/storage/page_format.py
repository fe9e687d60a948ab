"""The stored page format: a fixed header, the key, then the flat page payload.

    offset  size  field
    0       4     magic b"HKVP"
    4       2     format version (1)
    6       1     checksum algorithm (1 = xxh3_64, 2 = crc32, 7 = HMAC-SHA256 with the tier secret)
    7       1     key length K (1..MAX_KEY_BYTES)
    8       8     geometry fingerprint (KVGeometry.fingerprint's 16 hex digits as 8 bytes)
    16      8     model identity hash (first 8 bytes of sha256(model id))
    24      8     namespace hash (first 8 bytes of sha256(namespace))
    32      8     payload length P (little-endian u64)
    40      8     checksum or MAC over bytes [0, 40) + key + payload (little-endian u64)
    48      K     key
    48 + K  P     payload: one canonical flat page (KVGeometry.page_bytes)

The checksum is XXH3-64 when the `xxhash` package is installed, else zlib.crc32; the
algorithm byte records which, so a reader verifies with the writer's algorithm. Where the
C extension hicache.storage._xxh3 is built, it computes the XXH3-64 of a stored page (header
+ key + payload, always over 240 bytes) with the GIL released, so that reader threads
verify pages at the same time; python-xxhash, which holds the GIL, does the rest. A page
that fails any check raises PageError and is never served.

With a tier secret (TierIdentity.secret: --hicache-tier-secret-file or HICACHE_TIER_SECRET),
pages are written with algorithm 7: the checksum field holds the first 8 bytes of
HMAC-SHA256(secret, bytes [0, 40) + key + payload), and a reader with the secret serves only
pages whose MAC verifies (any other page is "forged": a miss, counted and removed). A reader
without a secret cannot verify a MAC'd page: "unreadable", a miss that leaves it in place.
"""

from __future__ import annotations

import hmac
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Literal

from hicache.storage.base import Buffer, Payload, TierIdentity

try:  # the same XXH3-64 without the GIL, for inputs over 240 bytes (the C extension; optional)
    from hicache.storage._xxh3 import copy_xxh3 as _copy_xxh3
    from hicache.storage._xxh3 import pread_xxh3 as _pread_xxh3
    from hicache.storage._xxh3 import xxh3_64_long as _xxh3_long
except ImportError:
    _xxh3_long = _pread_xxh3 = _copy_xxh3 = None  # type: ignore[assignment]

MAGIC = b"HKVP"
VERSION = 1
MAX_KEY_BYTES = 64
XXH3_64 = 1
CRC32 = 2
HMAC_SHA256 = 7  # two bits from 1 and 2: a one-bit flip of their algorithm byte stays "corrupt"
_FIXED = struct.Struct("<4sHBB8s8s8sQ")  # everything before the checksum: 40 bytes
_ALGORITHM_AT = struct.calcsize("<4sH")  # the checksum algorithm byte's offset in _FIXED
_CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = _FIXED.size + _CHECKSUM.size  # 48, before the key

Reason = Literal["corrupt", "foreign", "forged", "unreadable"]


class PageError(ValueError):
    """A stored page that must not be served. `reason` is "corrupt" (bad magic, version,
    length or checksum: torn or damaged bytes), "foreign" (intact, but written for another
    geometry, model, namespace or key), "forged" (read with a tier secret: no MAC, or one that
    does not verify) or "unreadable" (checksummed with an algorithm this process lacks, e.g.
    XXH3 without the xxhash package, or a MAC without the secret: a miss here, fine for
    others). Tiers delete corrupt, foreign and forged pages, never unreadable ones."""

    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"{reason} page: {detail}")
        self.reason: Reason = reason


def _checksummer(algorithm: int, secret: bytes = b"") -> Callable[[list[Buffer]], int] | None:
    if algorithm == HMAC_SHA256:
        if not secret:
            return None

        def mac(parts: list[Buffer]) -> int:
            h = hmac.new(secret, digestmod="sha256")
            for p in parts:
                h.update(p)
            return int.from_bytes(h.digest()[:8], "little")

        return mac
    if algorithm == XXH3_64:
        try:
            import xxhash
        except ImportError:
            return None

        def xxh(parts: list[Buffer]) -> int:
            if _xxh3_long is not None and (value := _xxh3_long(parts)) is not None:
                return value
            h = xxhash.xxh3_64()
            for p in parts:
                h.update(p)
            return int(h.intdigest())

        return xxh
    if algorithm == CRC32:

        def crc(parts: list[Buffer]) -> int:
            value = 0
            for p in parts:
                value = zlib.crc32(p, value)
            return value

        return crc
    return None


def hashes_without_gil() -> bool:
    """Whether a large page's default checksum runs without the GIL (the C XXH3), so that
    several threads can checksum pages at once."""
    return _xxh3_long is not None and default_algorithm() == XXH3_64


def default_algorithm() -> int:
    """XXH3_64 when xxhash is importable, else CRC32."""
    return XXH3_64 if _checksummer(XXH3_64) is not None else CRC32


def check_key(key: bytes) -> None:
    """Raise ValueError unless `key` is bytes of length 1..MAX_KEY_BYTES."""
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a page key must be 1..{MAX_KEY_BYTES} bytes, got {key!r}")


def stored_size(identity: TierIdentity, key: bytes) -> int:
    """Bytes of one stored page of `identity` under `key`: header + key + payload."""
    return HEADER_BYTES + len(key) + identity.page_bytes


def payload_parts(payload: Payload) -> list[memoryview]:
    """A page payload as byte views in page order: a list's items (a host page's pieces),
    or the one buffer."""
    if isinstance(payload, list):
        return [memoryview(p).cast("B") for p in payload]
    return [memoryview(payload).cast("B")]


def checked_parts(identity: TierIdentity, key: bytes, payload: Payload) -> list[memoryview]:
    """The payload's byte views (payload_parts) once the key and the payload's length are
    right for `identity`. Raises ValueError otherwise."""
    check_key(key)
    parts = payload_parts(payload)
    size = sum(p.nbytes for p in parts)
    if size != identity.page_bytes:
        raise ValueError(f"page payload must be {identity.page_bytes} bytes for this geometry, got {size}")
    return parts


def _fixed(identity: TierIdentity, key: bytes, algorithm: int) -> bytes:
    fp, model, ns = identity.fingerprint_bytes, identity.model_hash, identity.namespace_hash
    return _FIXED.pack(MAGIC, VERSION, algorithm, len(key), fp, model, ns, identity.page_bytes)


def _writer_algorithm(identity: TierIdentity) -> int:
    """HMAC_SHA256 with a tier secret, else the default checksum."""
    return HMAC_SHA256 if identity.secret else default_algorithm()


def encode_header(identity: TierIdentity, key: bytes, payload: Payload, algorithm: int | None = None) -> bytes:
    """The header + key to store in front of `payload` (written as-is after it: one buffer,
    or a list of buffers in page order), checksummed with `algorithm` (default: a MAC with
    the identity's tier secret, else the default checksum).

    Raises ValueError for a bad key or a payload that is not identity.page_bytes long.
    """
    parts = checked_parts(identity, key, payload)
    algorithm = _writer_algorithm(identity) if algorithm is None else algorithm
    summer = _checksummer(algorithm, identity.secret)
    if summer is None:
        raise ValueError(f"checksum algorithm {algorithm} is unknown or not installed")
    fixed = _fixed(identity, key, algorithm)
    return fixed + _CHECKSUM.pack(summer([fixed, key, *parts])) + key


def stage_page(identity: TierIdentity, key: bytes, parts: Sequence[memoryview], dest: memoryview) -> None:
    """Write the stored page of `parts` (checked_parts' views) into `dest` (a writable byte
    view of stored_size bytes): with the C extension the payload is hashed as it is copied,
    one pass over its bytes, else encode_header then a copy."""
    head = HEADER_BYTES + len(key)
    if _copy_xxh3 is not None and _writer_algorithm(identity) == XXH3_64:
        fixed = _fixed(identity, key, XXH3_64)
        checksum = _copy_xxh3([fixed, key], parts, [dest[head:]])
        if checksum is None:  # 240 bytes or less: python-xxhash's, over what was copied
            checksum = _checksummer(XXH3_64)([fixed, key, dest[head:]])  # type: ignore[misc]
        dest[:head] = fixed + _CHECKSUM.pack(checksum) + key
        return
    dest[:head] = encode_header(identity, key, list(parts))
    at = head
    for part in parts:
        dest[at : at + part.nbytes] = part
        at += part.nbytes


def unstage_page(identity: TierIdentity, key: bytes, stored: memoryview, pieces: Sequence[memoryview]) -> None:
    """Verify a stored page of stored_size bytes read into `stored` and copy its payload into
    `pieces` (in order; they may hold any bytes if it fails). With the C extension the payload
    is hashed as it is copied. Raises PageError as decode_page does."""
    head = HEADER_BYTES + len(key)
    xxh3 = stored.nbytes > _ALGORITHM_AT and stored[_ALGORITHM_AT] == XXH3_64
    if _copy_xxh3 is not None and xxh3 and not identity.secret:
        checksum = _copy_xxh3([stored[: _FIXED.size], stored[HEADER_BYTES:head]], [stored[head:]], pieces)
        verify_page(identity, key, stored[:head], pieces, checksum=checksum)
        return
    payload = decode_page(identity, key, stored)
    at = 0
    for piece in pieces:
        piece[:] = payload[at : at + piece.nbytes]
        at += piece.nbytes


def encode_page(identity: TierIdentity, key: bytes, payload: Buffer) -> bytes:
    """Header + key + payload as one bytes object (one copy of the payload)."""
    return encode_header(identity, key, payload) + bytes(payload)


def decode_page(identity: TierIdentity, key: bytes, blob: Buffer) -> memoryview:
    """Verify a stored page and return a view of its payload (no copy).

    Raises PageError("corrupt") for wrong magic, version, lengths, checksum or an unknown
    checksum algorithm, PageError("unreadable") for a known algorithm this process lacks,
    PageError("forged") with a tier secret for a page without a valid MAC, and
    PageError("foreign") for an intact page of another geometry, model, namespace or key.
    """
    view = memoryview(blob).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise PageError("corrupt", f"{view.nbytes} bytes is shorter than the {HEADER_BYTES}-byte header")
    key_len = view[7]
    payload = view[HEADER_BYTES + key_len :]
    verify_page(identity, key, view[: HEADER_BYTES + key_len], [payload])
    return payload


def read_payload_checksummed(fd: int, head: memoryview, pieces: Sequence[memoryview]) -> tuple[int, int | None] | None:
    """After a page file's header + key were read into `head` from the file's start: read
    its payload into `pieces` (in order) and compute the page's XXH3-64 as each window of
    bytes lands, in C without the GIL. Returns (payload bytes read, the checksum, or None
    after a short read) for verify_page(checksum=...), or None when the header names another
    algorithm or the extension is not built: the caller reads, verify_page computes it.
    OSError for a failed read."""
    if _pread_xxh3 is None or head.nbytes < HEADER_BYTES or head[_ALGORITHM_AT] != XXH3_64:
        return None
    return _pread_xxh3(fd, head.nbytes, [head[: _FIXED.size], head[HEADER_BYTES:]], pieces)


def verify_page(
    identity: TierIdentity, key: bytes, head: Buffer, payload: Sequence[Buffer], checksum: int | None = None
) -> None:
    """Verify a stored page read as its header + key (`head`) and its payload in pieces
    (`payload`, in order: e.g. read straight into a host page's chunks). `checksum`: the
    XXH3-64 computed while the page was read (read_payload_checksummed), used when the header
    names XXH3-64 instead of hashing the bytes again. Raises PageError as decode_page does."""
    view = memoryview(head).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise PageError("corrupt", f"{view.nbytes} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, version, algorithm, key_len, fp, model, ns, size = _FIXED.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise PageError("corrupt", f"magic {magic!r} version {version}")
    got = view.nbytes + sum(memoryview(p).nbytes for p in payload)
    if view.nbytes != HEADER_BYTES + key_len or got != HEADER_BYTES + key_len + size:
        raise PageError("corrupt", f"{got} bytes, header says {HEADER_BYTES + key_len + size}")
    if identity.secret and algorithm != HMAC_SHA256:
        raise PageError("forged", f"no MAC (checksum algorithm {algorithm}): written without the tier secret")
    summer = _checksummer(algorithm, identity.secret)
    if summer is None and algorithm == XXH3_64:
        raise PageError("unreadable", "checksummed with xxh3_64, and the xxhash package is not installed")
    if summer is None and algorithm == HMAC_SHA256:
        raise PageError("unreadable", "authenticated with a tier secret, and this sidecar has none")
    if summer is None:
        raise PageError("corrupt", f"checksum algorithm {algorithm} is unknown")
    (expected,) = _CHECKSUM.unpack_from(view, _FIXED.size)
    stored_key = view[HEADER_BYTES:]
    if checksum is None or algorithm != XXH3_64:
        checksum = summer([view[: _FIXED.size], stored_key, *payload])
    if algorithm == HMAC_SHA256 and not hmac.compare_digest(
        checksum.to_bytes(8, "little"), view[_FIXED.size : HEADER_BYTES]
    ):
        raise PageError("forged", "the MAC does not verify: another secret, or changed bytes")
    if checksum != expected:
        raise PageError("corrupt", "checksum mismatch")
    if fp != identity.fingerprint_bytes or size != identity.page_bytes:
        raise PageError("foreign", f"geometry {fp.hex()}, expected {identity.fingerprint}")
    if model != identity.model_hash or ns != identity.namespace_hash:
        raise PageError("foreign", "another model or namespace")
    if bytes(stored_key) != key:
        raise PageError("foreign", f"key {bytes(stored_key).hex()}, expected {key.hex()}")
