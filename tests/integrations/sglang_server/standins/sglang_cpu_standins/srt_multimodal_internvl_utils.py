"""For sglang/srt/multimodal/internvl_utils.py, which imports torchvision at module level.

PyPI's torchvision is a CUDA build that fails to import beside a CPU torch, and a text model
never calls it: while that file runs, an inert torchvision (transforms, functional's
InterpolationMode) stands in. Any call into it raises.
"""

from __future__ import annotations

from types import ModuleType


class InterpolationMode:
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


class _Inert(ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(*args: object, **kwargs: object) -> object:
            raise RuntimeError(f"torchvision.{name}: torchvision is a stand-in here (no image models on CPU)")

        return refuse


def torchvision() -> dict[str, ModuleType]:
    vision, transforms, functional = (
        _Inert("torchvision"),
        _Inert("torchvision.transforms"),
        _Inert("torchvision.transforms.functional"),
    )
    functional.InterpolationMode = transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    vision.transforms, transforms.functional = transforms, functional  # type: ignore[attr-defined]
    return {m.__name__: m for m in (vision, transforms, functional)}


before = torchvision
