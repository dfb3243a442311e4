"""The eager FP8 (e4m3) formulation the runtime's FP8 paths share: per-tensor scales and
saturating quantization. The Triton kernels (kernels/fp8_quant.py) are checked against it."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
SCALE_MIN = 1e-12  # a scale is never 0 (an all-zero tensor would divide by it)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale), saturating at +-448 (round to nearest even, like modelopt)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor scale amax / 448 as a float32 0-dim tensor (never 0)."""
    return (x.detach().abs().amax().float() / FP8_MAX).clamp(min=SCALE_MIN)
