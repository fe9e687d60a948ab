# Stub for the C extension built from _native.c (see hicache/transfer/native.py).
from typing import Any

HAVE_STREAMING_STORES: int

def copy_rows(
    dst_addr: int, dst_size: int, src_addr: int, src_size: int, descriptors: Any, group: int, streaming: bool, /
) -> None: ...
