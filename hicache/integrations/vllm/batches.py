"""How many page keys one call to the sidecar carries.

The sidecar answers INVALID_ARGUMENT to a call of more keys than its --max-batch (65,536 by
default), and vLLM can ask about or move more pages than that in one step. So the adapter
cuts every keyed call (Lookup, Prefetch, Pin, Unpin, Offload, Reload) into batches of at
most BATCH keys: well under the default, and a sidecar started with --max-batch of BATCH or
more serves them all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")
BATCH = 4096  # page keys per sidecar call


def batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """`items` in order, as consecutive slices of at most `size`. Raises ValueError for a
    size below 1."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    for start in range(0, len(items), size):
        yield items[start : start + size]
