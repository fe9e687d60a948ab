# Stub for the C extension built from _native.c, _native_plan.c, _native_queue.c and _native_crew.c (see hicache/transfer/native.py).
from typing import Any

HAVE_STREAMING_STORES: int
HOLD_GIL_BYTES: int

def copy_pieces(
    dst_addr: int,
    dst_size: int,
    src_addr: int,
    src_size: int,
    descs: Any,
    layer_ends: Any,
    group: int,
    streaming: bool,
    threads: int,
    piece_bytes: int,
    progress_addr: int,
    /,
) -> None: ...
def copy_pages(
    dst_addr: int,
    dst_size: int,
    src_addr: int,
    src_size: int,
    template: Any,
    src_step: Any,
    dst_step: Any,
    src_pages: Any,
    dst_pages: Any,
    layers: int,
    streaming: bool,
    threads: int,
    piece_bytes: int,
    progress_addr: int,
    /,
) -> None: ...
def wait_progress(addr: int, target: int, timeout_s: float, /) -> int: ...
def publish(addr: int, value: int, /) -> None: ...
def hold_gil_bytes(n: int = ..., /) -> int: ...
def gil_releases() -> int: ...
def build_descriptors(
    src_strides: Any,
    dst_strides: Any,
    page_size: int,
    src_pages: Any,
    dst_pages: Any,
    layers: Any,
    by_layer: bool,
    key_is_src: bool,
    /,
) -> tuple[bytearray, bytearray]: ...
def merge_descriptors(descs: Any, positions: Any, layers: int, cap: int, /) -> tuple[bytearray, bytearray]: ...

class CopyQueue:
    def __init__(self) -> None: ...
    def submit(
        self,
        dst_addr: int,
        dst_size: int,
        src_addr: int,
        src_size: int,
        descs: Any,
        layer_ends: Any,
        group: int,
        streaming: bool,
        threads: int,
        piece_bytes: int,
        progress_addr: int,
        keep: object,
        /,
    ) -> None: ...
    def pending(self) -> int: ...
    def close(self) -> None: ...
