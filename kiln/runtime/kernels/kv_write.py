"""KV-cache write (reshape_and_cache): new k/v [T, KVH, D] into one layer's paged cache.

Cache of one layer: [num_blocks, block_size, KVH, D]; token t goes to slot
``slot_mapping[t]`` = block * block_size + offset; a negative slot skips the token (padding).
An FP8 (float8_e4m3fn) cache stores x / scale, saturated to ±448, with per-tensor scales.
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

FP8_MAX = 448.0


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    IS_FP8: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    m = (h < kv_heads) & (d < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=m)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=m)
    if IS_FP8:
        k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -448.0, 448.0)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=m)


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Write k, v [T, KVH, D] into k_cache, v_cache [num_blocks, block_size, KVH, D] in place.

    slot_mapping [T] int32/int64 (negative = skip). Caches are the input dtype (or any float
    dtype: values are cast) or float8_e4m3fn, which stores clamp(x / scale, ±448); scales are
    floats or 1-element float32 device tensors (``cache.k_scale[layer : layer + 1]``).
    """
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,), device=k.device)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES + FP8_DTYPES, device=k.device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=k.device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=k.device)
    t, heads, dim = k.shape
    check_shape("v", v, (t, heads, dim))
    check_shape("k_cache", k_cache, (None, None, heads, dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("slot_mapping", slot_mapping, (t,))
    is_fp8 = k_cache.dtype in FP8_DTYPES
    if t == 0:
        return
    ks = scale_tensor("k_scale", k_scale, k.device) if is_fp8 else slot_mapping
    vs = scale_tensor("v_scale", v_scale, k.device) if is_fp8 else slot_mapping
    _kv_write_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, ks, vs,
        heads, dim, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        IS_FP8=is_fp8, H_PAD=triton.next_power_of_2(heads),
        D_PAD=triton.next_power_of_2(dim), num_warps=4, **_pdl.launch_kwargs(),
    )


def reshape_and_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Torch reference (write_kv's index_copy_, plus the FP8 scaling); mutates the caches."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[-2:])
        if cache.dtype in FP8_DTYPES:
            x = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
        flat[slots] = x.to(cache.dtype)  # index_copy_ has no CPU float8 kernel
