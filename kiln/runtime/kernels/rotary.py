"""Rotary embedding (rotate-half / neox layout), in place on q and k; and the same fused with
the KV-cache write (``rotary_and_cache_``: one launch per layer instead of two).

``cos_sin_cache`` [max_positions, head_dim] float32 holds cos(pos * inv_freq) in its first
half and sin in its second (``build_cos_sin_cache``); the kernel computes in float32 and
rounds once, where the eager path (kiln/runtime/layers/rotary.py) rounds cos/sin and each
product to the model dtype: equal in float32, within bf16 rounding otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    check_shape,
    check_tensor,
    scale_tensor,
)
from kiln.runtime.kernels._pdl import pdl_begin


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
    r1 = (x1 * cos - x2 * sin).to(ptr.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(ptr.dtype.element_ty)
    tl.store(p, r1, mask=m)
    tl.store(p + half, r2, mask=m)
    return r1, r2  # the rotated halves [HEADS_PAD, HALF_PAD], as stored


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, t, stride_ct, half, HALF_PAD: tl.constexpr):
    """Token t's column offsets [1, HALF_PAD], their mask, and cos / sin at its position."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    dm = d < half
    cos = tl.load(cache_ptr + pos * stride_ct + d, mask=dm, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_ct + half + d, mask=dm, other=0.0)
    return d, dm, cos, sin


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr, num_heads, num_kv_heads, half,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, HALF_PAD: tl.constexpr, PDL: tl.constexpr,
    STAGED_EARLY: tl.constexpr,
):
    if not STAGED_EARLY:
        pdl_begin(PDL)
    t = tl.program_id(0)
    # positions are staged before the step and cos/sin is constant: with STAGED_EARLY they
    # are read before the PDL wait
    _, _, cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_ct, half, HALF_PAD)
    if STAGED_EARLY:
        pdl_begin(PDL)
    _rotate(q_ptr, stride_qt, stride_qh, t, num_heads, cos, sin, half, QH_PAD, HALF_PAD)
    _rotate(k_ptr, stride_kt, stride_kh, t, num_kv_heads, cos, sin, half, KH_PAD, HALF_PAD)


@triton.jit
def _rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cache_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_heads, num_kv_heads, half, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    IS_FP8: tl.constexpr, QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    PDL: tl.constexpr, STAGED_EARLY: tl.constexpr,
):
    if not STAGED_EARLY:
        pdl_begin(PDL)
    t = tl.program_id(0)
    # positions and slots are staged before the step, cos/sin and the scales are constant:
    # with STAGED_EARLY they are read before the PDL wait
    d, dm, cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_ct, half, HALF_PAD)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if STAGED_EARLY:
        pdl_begin(PDL)
    _rotate(q_ptr, stride_qt, stride_qh, t, num_heads, cos, sin, half, QH_PAD, HALF_PAD)
    # k: rotated in place (as rotary_embedding_) and written to the cache with v
    r1, r2 = _rotate(k_ptr, stride_kt, stride_kh, t, num_kv_heads, cos, sin, half, KH_PAD,
                     HALF_PAD)
    h = tl.arange(0, KH_PAD)[:, None]
    m = (h < num_kv_heads) & dm
    if slot >= 0:  # negative: a padding token, nothing cached
        vp = v_ptr + t * stride_vt + h * stride_vh + d
        v1 = tl.load(vp, mask=m, other=0.0)
        v2 = tl.load(vp + half, mask=m, other=0.0)
        kc = kc_ptr + (slot // block_size) * stride_kcb + (slot % block_size) * stride_kcs \
            + h * stride_kch + d
        vc = vc_ptr + (slot // block_size) * stride_vcb + (slot % block_size) * stride_vcs \
            + h * stride_vch + d
        if IS_FP8:  # the cache stores clamp(x / scale, +-448), from the rounded k (as kv_write)
            ks = tl.load(k_scale_ptr)
            vs = tl.load(v_scale_ptr)
            w1 = tl.clamp(r1.to(tl.float32) / ks, -448.0, 448.0)
            w2 = tl.clamp(r2.to(tl.float32) / ks, -448.0, 448.0)
            v1 = tl.clamp(v1.to(tl.float32) / vs, -448.0, 448.0)
            v2 = tl.clamp(v2.to(tl.float32) / vs, -448.0, 448.0)
            tl.store(kc, w1.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(kc + half, w2.to(kc_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(kc, r1.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(kc + half, r2.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc, v1.to(vc_ptr.dtype.element_ty), mask=m)
        tl.store(vc + half, v2.to(vc_ptr.dtype.element_ty), mask=m)


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
    rotary_checks(q, k, positions, cos_sin_cache)
    t, heads, dim = q.shape
    if t == 0:
        return
    half = dim // 2
    _rotary_kernel[(t,)](
        q, k, positions, cos_sin_cache, heads, k.shape[1], half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        QH_PAD=triton.next_power_of_2(heads), KH_PAD=triton.next_power_of_2(k.shape[1]),
        HALF_PAD=triton.next_power_of_2(half), num_warps=4,
        STAGED_EARLY=_pdl.staged_early(),
        **_pdl.launch_kwargs(),
    )


def rotary_checks(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor) -> None:
    """The argument checks of the rotary wrappers (one clear error per bad argument)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=q.device)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,),
                 device=q.device)
    t, _, dim = q.shape
    check_shape("k", k, (t, None, dim))
    check_shape("positions", positions, (t,))
    check_shape("cos_sin_cache", cos_sin_cache, (None, dim))
    if dim % 2:
        raise ValueError(f"head_dim {dim} must be even for rotate-half rotary")


def rotary_and_cache_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """``rotary_embedding_(q, k, ...)`` then ``reshape_and_cache(k, v, ...)`` in one kernel.

    q [T, H, D] and k [T, KVH, D] are rotated in place; the rotated k and v [T, KVH, D] go to
    k_cache / v_cache [num_blocks, block_size, KVH, D] at ``slot_mapping`` [T] (negative =
    skip), bf16/fp16/fp32 caches in their dtype, float8_e4m3fn as clamp(x / scale, +-448).
    """
    rotary_checks(q, k, positions, cos_sin_cache)
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,), device=k.device)
    check_shape("v", v, tuple(k.shape))
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES + FP8_DTYPES, device=k.device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=k.device)
    check_shape("k_cache", k_cache, (None, None, k.shape[1], k.shape[2]))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=k.device)
    t, heads, dim = q.shape
    check_shape("slot_mapping", slot_mapping, (t,))
    if t == 0:
        return
    fp8 = k_cache.dtype in FP8_DTYPES
    ks = scale_tensor("k_scale", k_scale, k.device) if fp8 else slot_mapping
    vs = scale_tensor("v_scale", v_scale, k.device) if fp8 else slot_mapping
    half = dim // 2
    _rotary_cache_kernel[(t,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs,
        heads, k.shape[1], half, k_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        IS_FP8=fp8, QH_PAD=triton.next_power_of_2(heads),
        KH_PAD=triton.next_power_of_2(k.shape[1]), HALF_PAD=triton.next_power_of_2(half),
        num_warps=4, STAGED_EARLY=_pdl.staged_early(),
        **_pdl.launch_kwargs(),
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
