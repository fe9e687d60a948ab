"""For sglang/srt/mem_cache/pool_host/base.py, whose HostKVCache pins its host memory
(cudaHostRegister, pin_memory=True buffers) even where there is no CUDA: start-up fails, and
so does every storage fetch. Without CUDA the host pool is built with pin_memory=False."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch


def after(module: ModuleType) -> None:
    init = module.HostKVCache.__init__

    @functools.wraps(init)
    def unpinned(self: Any, *args: Any, **kwargs: Any) -> None:
        if not torch.cuda.is_available() and "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    module.HostKVCache.__init__ = unpinned
