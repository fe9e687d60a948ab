"""HiCacheLoadStoreSpec: what the vLLM manager hands the workers for one load or store.

The scheduler-side manager (manager.py) makes one per prepare_load and prepare_store; vLLM
passes it to the workers (worker.py), which copy those chunks' blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.kv_offload.base import LoadStoreSpec


class HiCacheLoadStoreSpec(LoadStoreSpec):  # type: ignore[misc]
    """The chunks of one load or store, by OffloadKey, in vLLM's group order."""

    def __init__(self, keys: Iterable[bytes]):
        self.keys = [bytes(k) for k in keys]

    def __repr__(self) -> str:
        return f"HiCacheLoadStoreSpec({len(self.keys)} chunks)"
