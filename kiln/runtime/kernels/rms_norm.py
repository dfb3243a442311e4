"""RMSNorm, optionally fused with the residual add, in kiln's reference numerics.

``fused_add_rms_norm(x, residual, w)``: new_residual = x + residual (rounded to the input
dtype, as the eager add is); out = w * rmsnorm(new_residual) with float32 statistics, the
normalised value rounded to the input dtype before the weight is applied
(kiln/runtime/layers/norm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor
from kiln.runtime.kernels._pdl import pdl_begin
from kiln.runtime.layers.norm import rms_norm as _rms_norm_torch


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps,
    stride_xt, stride_rt, stride_ot, stride_rot,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < hidden
    x = tl.load(x_ptr + t * stride_xt + offs, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * stride_rot + offs, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=m)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_shape("weight", weight, (x.shape[1],))


def _launch(x, res, weight, out, res_out, eps) -> None:
    if x.shape[0] == 0:
        return
    hidden = x.shape[1]
    block = triton.next_power_of_2(hidden)
    if block > 65536:
        raise ValueError(f"hidden size {hidden} is over the kernel's one-row limit 65536")
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_norm_kernel[(x.shape[0],)](
        x, res if res is not None else x, weight, out, res_out if res_out is not None else out,
        hidden, eps, x.stride(0), res.stride(0) if res is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        HAS_RESIDUAL=res is not None, BLOCK=block, num_warps=warps, **_pdl.launch_kwargs(),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden], weight [hidden] (x's dtype) → [T, hidden]."""
    _check(x, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, weight, out, None, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, hidden] → (w * rmsnorm(x + residual), x + residual), both new tensors."""
    _check(x, weight)
    check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("residual", residual, tuple(x.shape))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, out, res_out, eps)
    return out, res_out


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager path: ``h = x + residual; rms_norm(h, w, eps)`` (residual None: h = x)."""
    h = x if residual is None else x + residual
    return _rms_norm_torch(h, weight, eps), h
