"""The eager FP8 (e4m3) formulation the runtime's FP8 paths share: saturating quantization,
per-tensor scales (weights, static activation scales) and per-token scales (dynamic
activations). The Triton kernels (kernels/fp8_quant.py, and the norm and activation kernels
that write e4m3 themselves) are checked against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
SCALE_MIN = 1e-12  # a scale is never 0 (an all-zero tensor would divide by it)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale), saturating at +-448 (round to nearest even, like modelopt). ``scale``
    is per tensor, or [..., 1]: one per row of x."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor scale amax / 448 as a float32 0-dim tensor (never 0)."""
    return (x.detach().abs().amax().float() / FP8_MAX).clamp(min=SCALE_MIN)


def fp8_scale_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token scales of x [..., K]: [..., 1] float32, each row's
    max(amax * fp32(1 / 448), 1e-12). A multiplication by the float32 reciprocal (one IEEE
    product, the same on every device and in the kernels), not a division."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    return (amax * (1.0 / FP8_MAX)).clamp(min=SCALE_MIN)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3(x / s), s) with s = ``fp8_scale_per_token(x)`` [..., 1]."""
    s = fp8_scale_per_token(x)
    return quantize_fp8(x, s), s


def pad_rows(q: torch.Tensor, scale: torch.Tensor | None, row_pad: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """e4m3 rows q [M, K] (and their per-token scales [M, 1]) padded to M rounded up to
    ``row_pad`` rows: zero rows, scales 1e-12 (what the kernels write there)."""
    pad = -q.shape[0] % row_pad
    if not pad:
        return q, scale
    q = F.pad(q.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
    if scale is not None:
        scale = F.pad(scale, (0, 0, 0, pad), value=SCALE_MIN)
    return q, scale
