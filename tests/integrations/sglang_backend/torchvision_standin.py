"""Test support: an inert `torchvision` (it stands in for the torchvision package) for CPU-only
environments that import SGLang's KV-cache modules.

SGLang's config modules import torchvision at module level but its KV-cache code never calls
it, and PyPI's torchvision replaces a CPU torch with a CUDA build. install() imports sglang
first (transformers must find torchvision absent before the stand-in exists); call it
before importing `sglang.srt.mem_cache.pool_host`. A real torchvision, when present, is
left alone.
"""

from __future__ import annotations

import sys
import types


def install() -> None:
    import sglang  # noqa: F401  (see the module's docstring)

    if "torchvision" in sys.modules:
        return
    try:
        import torchvision  # noqa: F401  (a real one wins)

        return
    except Exception:
        pass
    vision = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")

    class InterpolationMode:  # read only inside SGLang functions that the KV cache never calls
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        LANCZOS = "lanczos"

    functional.InterpolationMode = transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    vision.transforms = transforms  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    sys.modules.update(
        {"torchvision": vision, "torchvision.transforms": transforms, "torchvision.transforms.functional": functional}
    )
