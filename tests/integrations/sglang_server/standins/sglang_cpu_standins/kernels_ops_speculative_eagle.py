"""For sglang/kernels/ops/speculative/eagle.py, which on CPU imports speculative-decoding ops from sgl_kernel (PyPI has
no CPU sgl_kernel). The tests never decode speculatively, so they refuse when called."""

from __future__ import annotations

from types import ModuleType

from . import refusing_kernel


def before() -> dict[str, ModuleType]:
    return refusing_kernel(
        "sglang/kernels/ops/speculative/eagle.py", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu"
    )
