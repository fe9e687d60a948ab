"""For sglang/kernels/ops/speculative/multi_layer_eagle.py, which on CPU imports speculative-decoding ops from sgl_kernel (PyPI has
no CPU sgl_kernel). The tests never decode speculatively, so they refuse when called."""

from __future__ import annotations

from types import ModuleType

from . import refusing_kernel


def before() -> dict[str, ModuleType]:
    return refusing_kernel("sglang/kernels/ops/speculative/multi_layer_eagle.py", "rotate_input_ids_cpu")
