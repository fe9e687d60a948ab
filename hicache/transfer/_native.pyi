# Stub for the C extension built from _native.c (see hicache/transfer/native.py).
from collections.abc import Sequence
from typing import Any

HAVE_STREAMING_STORES: int

def copy_shares(
    dst_addr: int,
    dst_size: int,
    src_addr: int,
    src_size: int,
    shares: Sequence[tuple[Any, Any]],
    group: int,
    streaming: bool,
    progress_addrs: Sequence[int],
    /,
) -> None: ...
def wait_progress(addr: int, target: int, timeout_s: float, /) -> int: ...
def publish(addr: int, value: int, /) -> None: ...
