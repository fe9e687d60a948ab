"""Stand-ins for SGLang 0.5.23's CPU gaps, for `make sglang-env`'s .venv-sglang only.

The make target writes a .pth file into the venv that puts this folder on sys.path and
imports this package; install() then acts only where SGLANG_USE_CPU_ENGINE=1 (SGLang's CPU
engine), so `python -m sglang.launch_server --device cpu` runs as it is. Each module here is
named after the SGLang file it stands in for (srt_a_b.py for sglang/srt/a/b.py) and has
`before()` (modules to place in sys.modules while that file runs, removed after it) and/or
`after(module)` (names to set in it once it ran). Nothing of hicache lives here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

STANDINS = {
    "sglang.srt.multimodal.internvl_utils": "srt_multimodal_internvl_utils",
    "sglang.srt.configs.deepseek_ocr": "srt_configs_deepseek_ocr",
    "sglang.srt.mem_cache.allocation": "srt_mem_cache_allocation",
    "sglang.kernels.ops.speculative.multi_layer_eagle": "kernels_ops_speculative_multi_layer_eagle",
    "sglang.kernels.ops.speculative.eagle": "kernels_ops_speculative_eagle",
    "sglang.kernels.ops.speculative.cache_locs": "kernels_ops_speculative_cache_locs",
    "sglang.kernels.ops.speculative.spec_tree": "kernels_ops_speculative_spec_tree",
    "sglang.kernels.ops.kvcache.cache_move": "kernels_ops_kvcache_cache_move",
    "sglang.srt.mem_cache.pool_host.base": "srt_mem_cache_pool_host_base",
    "sglang.srt.mem_cache.pool_host.mha": "srt_mem_cache_pool_host_mha",
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, stand_in: ModuleType):
        self.inner, self.stand_in = inner, stand_in

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        before = getattr(self.stand_in, "before", dict)()
        saved = {name: sys.modules.get(name) for name in before}
        sys.modules.update(before)
        try:
            self.inner.exec_module(module)
        finally:
            for name, old in saved.items():
                if old is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = old
        getattr(self.stand_in, "after", lambda m: None)(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tracebacks
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in STANDINS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, importlib.import_module(f"{__name__}.{STANDINS[name]}"))
        return spec


def install() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()


def refusing_kernel(for_file: str, *names: str) -> dict[str, ModuleType]:
    """An sgl_kernel whose `names` raise when called: CPU ops that `for_file` imports at module
    level for paths these tests never take (speculative decoding, ...)."""
    kernel = ModuleType("sgl_kernel")
    for name in names:

        def refuse(*args: object, _name: str = name, **kwargs: object) -> None:
            raise NotImplementedError(f"sgl_kernel.{_name} (imported by {for_file}) is a stand-in that refuses")

        setattr(kernel, name, refuse)
    return {"sgl_kernel": kernel}
