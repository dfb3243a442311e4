"""Argument checks shared by the kernel wrappers (no triton import here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn,)


def check_tensor(
    name: str, t: object, ndim: int | None = None, dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None, last_contiguous: bool = True,
) -> torch.Tensor:
    """Raise ValueError unless ``t`` is a tensor of the given rank, dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(
            f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the input)")
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")
    return t


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Raise ValueError unless ``t.shape`` matches ``shape`` (None = any size)."""
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
    if not ok:
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (``triton.cdiv``, without importing triton)."""
    return (a + b - 1) // b


def scale_tensor(name: str, scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A per-tensor scale as a 1-element float32 device tensor the kernel reads (no sync).

    Accepts a Python float (copied to the device) or a 1-element tensor on ``device``
    (e.g. ``cache.k_scale[layer : layer + 1]``, used as is).
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.device != device or scale.dtype != torch.float32:
            raise ValueError(
                f"{name} must be a float or a 1-element float32 tensor on {device}, got "
                f"shape {tuple(scale.shape)} {scale.dtype} on {scale.device}"
            )
        return scale.reshape(1)
    if not scale > 0:
        raise ValueError(f"{name} must be > 0, got {scale}")
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)
