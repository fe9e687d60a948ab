"""For sglang/kernels/ops/speculative/cache_locs.py, which on CPU imports speculative-decoding ops from sgl_kernel (PyPI has
no CPU sgl_kernel). The tests never decode speculatively, so they refuse when called."""

from __future__ import annotations

from types import ModuleType

from . import refusing_kernel


def before() -> dict[str, ModuleType]:
    return refusing_kernel(
        "sglang/kernels/ops/speculative/cache_locs.py",
        "assign_draft_cache_locs_contiguous_cpu",
        "assign_extend_cache_locs_cpu",
    )
