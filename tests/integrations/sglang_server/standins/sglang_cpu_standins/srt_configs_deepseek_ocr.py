"""For sglang/srt/configs/deepseek_ocr.py, which imports torchvision's InterpolationMode at
module level: the same inert torchvision as for sglang/srt/multimodal/internvl_utils.py."""

from __future__ import annotations

from .srt_multimodal_internvl_utils import torchvision as before  # noqa: F401
