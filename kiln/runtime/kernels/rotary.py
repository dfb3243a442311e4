"""Rotary embedding (rotate-half / neox layout), in place on q and k.

``cos_sin_cache`` [max_positions, head_dim] float32 holds cos(pos * inv_freq) in its first
half and sin in its second (``build_cos_sin_cache``); the kernel computes in float32 and
rounds once, where the eager path (kiln/runtime/layers/rotary.py) rounds cos/sin and each
product to the model dtype: equal in float32, within bf16 rounding otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor


@triton.jit
def _rotate(ptr, stride_t, stride_h, t, heads, cos, sin, half,
            HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    m = (h < heads) & (d < half)
    p = ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + half, mask=m, other=0.0).to(tl.float32)
    # [x1, x2] * cos + [-x2, x1] * sin
    tl.store(p, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=m)
    tl.store(p + half, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr, num_heads, num_kv_heads, half,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    dm = d < half
    cos = tl.load(cache_ptr + pos * stride_ct + d, mask=dm, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_ct + half + d, mask=dm, other=0.0)
    _rotate(q_ptr, stride_qt, stride_qh, t, num_heads, cos, sin, half, QH_PAD, HALF_PAD)
    _rotate(k_ptr, stride_kt, stride_kh, t, num_kv_heads, cos, sin, half, KH_PAD, HALF_PAD)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos | sin of pos * inv_freq (as Rotary.cos_sin)."""
    pos = torch.arange(max_positions, device=inv_freq.device, dtype=torch.long)
    freqs = pos.float()[:, None] * inv_freq.float()[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def rotary_embedding_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place; positions [T] int32/int64.

    Positions must be < cos_sin_cache.shape[0] (not checked on the device: no host sync).
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=q.device)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,),
                 device=q.device)
    t, heads, dim = q.shape
    check_shape("k", k, (t, None, dim))
    check_shape("positions", positions, (t,))
    check_shape("cos_sin_cache", cos_sin_cache, (None, dim))
    if dim % 2:
        raise ValueError(f"head_dim {dim} must be even for rotate-half rotary")
    if t == 0:
        return
    half = dim // 2
    _rotary_kernel[(t,)](
        q, k, positions, cos_sin_cache, heads, k.shape[1], half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        QH_PAD=triton.next_power_of_2(heads), KH_PAD=triton.next_power_of_2(k.shape[1]),
        HALF_PAD=triton.next_power_of_2(half), num_warps=4,
    )


def rotary_embedding_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary in float32 (Rotary.apply's formula), rounded once; new tensors."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos = torch.cat((cs[:, :half], cs[:, :half]), -1)[:, None, :]
    sin = torch.cat((cs[:, half:], cs[:, half:]), -1)[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    return rot(q), rot(k)
