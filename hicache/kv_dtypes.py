"""The KV dtypes hicache stores: their canonical names, the aliases engines use for them, and
how each is held in memory (bits per element, the storage dtype). The sizes they give are
computed in hicache.geometry alone."""

from __future__ import annotations

# canonical name -> (bits per element, storage dtype name)
STORAGE: dict[str, tuple[int, str]] = {
    "bfloat16": (16, "bfloat16"),
    "float16": (16, "float16"),
    "float32": (32, "float32"),
    "float8_e4m3fn": (8, "uint8"),
    "float8_e5m2": (8, "uint8"),
    "fp4_e2m1": (4, "uint8"),
}
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp4": "fp4_e2m1",
}
DTYPES: tuple[str, ...] = tuple(STORAGE)
FP4_BLOCK = 16  # fp4 elements that share one uint8 scale


def normalize_dtype(name: str) -> str:
    """Map a dtype name or alias ("bf16", "fp8_e4m3", ...) to its canonical name.

    Raises ValueError for an unknown name or one that is not a string.
    """
    if not isinstance(name, str):
        raise ValueError(f"KV dtype must be a string, got {name!r}")
    canonical = _DTYPE_ALIASES.get(name, name)
    if canonical not in STORAGE:
        raise ValueError(f"unknown KV dtype {name!r}; expected one of {list(STORAGE)}")
    return canonical
