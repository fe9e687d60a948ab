"""Without its engine an adapter fails to import with one line that names the fix."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_sglang_adapter_without_sglang_names_the_make_target() -> None:
    with pytest.raises(ImportError, match=r"needs SGLang: install SGLang 0\.5\.23 \(`make sglang-env`"):
        import hicache.integrations.sglang  # noqa: F401


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_adapter_without_vllm_names_the_make_target() -> None:
    with pytest.raises(ImportError, match=r"needs vLLM: install vLLM 0\.33\.0 \(`make vllm-env`"):
        import hicache.integrations.vllm  # noqa: F401


def test_importing_hicache_never_imports_an_adapter() -> None:
    code = "import sys, hicache, hicache.client, hicache.sidecar; print(any(m.startswith('hicache.integrations.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
