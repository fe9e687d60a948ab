"""For sglang/kernels/ops/speculative/spec_tree.py, which on CPU imports speculative-decoding ops from sgl_kernel (PyPI has
no CPU sgl_kernel). The tests never decode speculatively, so they refuse when called."""

from __future__ import annotations

from types import ModuleType

from . import refusing_kernel


def before() -> dict[str, ModuleType]:
    return refusing_kernel(
        "sglang/kernels/ops/speculative/spec_tree.py", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu"
    )
