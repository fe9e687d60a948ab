"""cuMemcpyBatchAsync through ctypes: many 1-D copies queued on a stream in one driver call.

The copy engines then move every (page, layer) chunk without a kernel and without one API
call per chunk. The driver API (libcuda.so.1) is used rather than the runtime, so any
torch/cupy build works: CUDA 13 drivers export the 8-argument `cuMemcpyBatchAsync_v2`, and
drivers from 12.8 on the 9-argument `cuMemcpyBatchAsync` (with a failure index). Nothing is
loaded at import: `load()` returns the binding, or the reason there is none.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

MIN_DRIVER = 12080  # the first driver with cuMemcpyBatchAsync
SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources read in stream order
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: copy engines, not SMs


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (cuda.h)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


_P = ctypes.c_void_p
_SZ = ctypes.c_size_t


@dataclass
class BatchCopy:
    """A loaded cuMemcpyBatchAsync. Call it with uint64 pointer arrays and a CUstream."""

    lib: ctypes.CDLL
    driver_version: int
    has_fail_index: bool  # the 9-argument form (drivers before CUDA 13)

    def __post_init__(self) -> None:
        name = "cuMemcpyBatchAsync" if self.has_fail_index else "cuMemcpyBatchAsync_v2"
        self._fn = getattr(self.lib, name)
        args = [_P, _P, _P, _SZ, ctypes.POINTER(MemcpyAttributes), ctypes.POINTER(_SZ), _SZ]
        self._fn.argtypes = [*args, ctypes.POINTER(_SZ), _P] if self.has_fail_index else [*args, _P]
        self._fn.restype = ctypes.c_int
        self._attrs = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, flags=FLAG_PREFER_OVERLAP_WITH_COMPUTE)
        self._attr_index = _SZ(0)

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Queue copies of sizes[i] bytes from srcs[i] to dsts[i] on `stream` (not the legacy
        default stream 0, which the driver refuses). The arrays are read during the call only.
        Raises RuntimeError with the driver's error if the batch is refused."""
        count = len(sizes)
        if not (len(dsts) == len(srcs) == count):
            raise ValueError(f"dsts, srcs and sizes differ in length: {len(dsts)}, {len(srcs)}, {count}")
        if count == 0:
            return
        d, s, n = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        head = (d.ctypes.data, s.ctypes.data, n.ctypes.data, count, ctypes.byref(self._attrs))
        attr_index = ctypes.byref(self._attr_index)
        if self.has_fail_index:
            failed = _SZ((1 << 64) - 1)
            code = self._fn(*head, attr_index, 1, ctypes.byref(failed), stream)
            where = f" at copy {failed.value}" if failed.value < count else ""
        else:
            code = self._fn(*head, attr_index, 1, stream)
            where = ""
        if code:
            raise RuntimeError(f"cuMemcpyBatchAsync of {count} copies failed{where}: {self.error_text(code)}")

    def error_text(self, code: int) -> str:
        text = ctypes.c_char_p()
        self.lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        if self.lib.cuGetErrorString(code, ctypes.byref(text)) == 0 and text.value:
            return f"CUresult {code} ({text.value.decode(errors='replace')})"
        return f"CUresult {code}"


_lock = threading.Lock()
_loaded: dict[str, BatchCopy | str] = {}


def load(path: str = "libcuda.so.1") -> BatchCopy | str:
    """The driver's batch copy, or a one-line reason it is unavailable. Loaded once per path."""
    with _lock:
        if path not in _loaded:
            _loaded[path] = _load(path)
        return _loaded[path]


def _load(path: str) -> BatchCopy | str:
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return f"no CUDA driver library ({path}: {exc})"
    version = ctypes.c_int(0)
    lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < MIN_DRIVER:
        return f"the CUDA driver ({version.value}) is older than {MIN_DRIVER}, the first with cuMemcpyBatchAsync"
    if hasattr(lib, "cuMemcpyBatchAsync_v2"):
        return BatchCopy(lib, version.value, has_fail_index=False)
    if hasattr(lib, "cuMemcpyBatchAsync"):
        return BatchCopy(lib, version.value, has_fail_index=True)
    return f"the CUDA driver ({version.value}) exports no cuMemcpyBatchAsync"
