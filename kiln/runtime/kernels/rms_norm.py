"""RMSNorm, optionally fused with the residual add, in kiln's reference numerics.

``fused_add_rms_norm(x, residual, w)``: new_residual = x + residual (rounded to the input
dtype, as the eager add is); out = w * rmsnorm(new_residual) with float32 statistics, the
normalised value rounded to the input dtype before the weight is applied
(kiln/runtime/layers/norm.py).

Two gathers keep torch's kernels out of a decode graph's ends (a torch kernel is no PDL
launch, so each one is a full stop in the chain):

- ``embed_rms_norm(ids, table, w)``: the embedding rows and layer 0's input norm in one
  kernel (``F.embedding`` then ``rms_norm``).
- ``gather_add_rms_norm(x, residual, rows, w)``: the last residual add, the selection of the
  rows that need logits and the final norm in one kernel (``(x + residual)[rows]`` then
  ``rms_norm``), computed for the selected rows only.

Where the next projection is an FP8 GEMM on quantized activations, the norm writes them:
``fused_add_rms_norm_fp8`` / ``embed_rms_norm_fp8`` store e4m3(y / s) of the compute-dtype
output y with a static per-tensor s, or with each row's own s = max|y| / 448 (dynamic
per-token scales, computed from the row the program holds), in the same kernel
(kiln/runtime/kernels/fp8_quant.py has the shared arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor
from kiln.runtime.kernels._pdl import pdl_begin
from kiln.runtime.kernels.fp8_quant import (
    ROW_PAD,
    check_static_scale,
    e4m3_value,
    padded_rows,
    row_scale,
)
from kiln.runtime.layers.norm import rms_norm as _rms_norm_torch


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rows_ptr, scale_ptr, num_src, num_rows,
    hidden, eps, stride_xt, stride_rt, stride_ot, stride_rot,
    HAS_RESIDUAL: tl.constexpr, GATHER: tl.constexpr, WRITE_RES: tl.constexpr,
    FP8_OUT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, STAGED_EARLY: tl.constexpr,
):
    if not STAGED_EARLY:
        pdl_begin(PDL)
    offs = tl.arange(0, BLOCK)
    # the norm weight is read-only: with STAGED_EARLY loaded before the PDL wait, while the
    # kernel before this one still runs
    w = tl.load(w_ptr + offs, mask=offs < hidden, other=0.0).to(tl.float32)
    if STAGED_EARLY:
        pdl_begin(PDL)
    t = tl.program_id(0)
    # rows past num_rows (FP8 output's pad rows) read nothing: zeros, scale 1e-12
    row_ok = (offs * 0 + t) < num_rows  # a vector mask (the interpreter's)
    m = (offs < hidden) & row_ok
    src = t.to(tl.int64)
    if GATHER:  # output row t is input row rows[t]; rows outside [0, num_src) read zeros
        src = tl.load(rows_ptr + tl.minimum(t, num_rows - 1)).to(tl.int64)
        src_v = tl.zeros([BLOCK], dtype=tl.int64) + src
        m = m & (src_v >= 0) & (src_v < num_src)
    x = tl.load(x_ptr + src * stride_xt + offs, mask=m, other=0.0)
    dt = x_ptr.dtype.element_ty  # the compute dtype: every rounding point of the reference
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + src * stride_rt + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
    if WRITE_RES:  # the residual stream after the add (or the gathered rows)
        tl.store(res_out_ptr + t * stride_rot + offs, x, mask=(offs < hidden) & row_ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv).to(dt).to(tl.float32)
    y = (normed * w).to(dt)
    if FP8_OUT == 0:
        tl.store(out_ptr + t * stride_ot + offs, y, mask=offs < hidden)
    else:  # e4m3 of the compute-dtype output: FP8_OUT 1 static scale, 2 this row's own
        yf = y.to(tl.float32)
        if FP8_OUT == 1:
            scale = tl.load(scale_ptr)
        else:
            scale = row_scale(tl.max(tl.abs(yf), axis=0))
            tl.store(scale_ptr + t, scale)
        q = tl.where(row_ok, e4m3_value(yf, scale), 0.0)  # pad rows +0 (0 * -w is -0)
        tl.store(out_ptr + t * stride_ot + offs, q.to(out_ptr.dtype.element_ty),
                 mask=offs < hidden)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_shape("weight", weight, (x.shape[1],))


def _launch(x, res, weight, out, res_out, eps, rows: torch.Tensor | None = None,
            fp8: tuple[int, torch.Tensor] | None = None) -> None:
    """One program per output row: row t of ``out`` (and ``res_out``) from input row t, or
    from input row rows[t] with ``rows``. ``fp8`` = (FP8_OUT mode, scale): ``out`` is
    e4m3 [M_pad, hidden] and the first M rows (of ``res_out`` / ``rows``) are real."""
    if out.shape[0] == 0:
        return
    hidden = x.shape[1]
    block = triton.next_power_of_2(hidden)
    if block > 65536:
        raise ValueError(f"hidden size {hidden} is over the kernel's one-row limit 65536")
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    num_rows = out.shape[0]
    if fp8 is not None:
        num_rows = rows.shape[0] if rows is not None else x.shape[0]
    mode, scale = fp8 if fp8 is not None else (0, out)
    _rms_norm_kernel[(out.shape[0],)](
        x, res if res is not None else x, weight, out, res_out if res_out is not None else out,
        rows if rows is not None else out, scale, x.shape[0], num_rows, hidden, eps,
        x.stride(0), res.stride(0) if res is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        HAS_RESIDUAL=res is not None, GATHER=rows is not None, WRITE_RES=res_out is not None,
        FP8_OUT=mode, BLOCK=block, STAGED_EARLY=_pdl.staged_early(), num_warps=warps,
        **_pdl.launch_kwargs(),
    )


def _fp8_out(m: int, hidden: int, scale: torch.Tensor | None, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, torch.Tensor]]:
    """The e4m3 output [M_pad, hidden] of an FP8 norm, its scales (static: ``scale`` as
    [1]; dynamic: [M_pad, 1]) and ``_launch``'s ``fp8`` argument."""
    check_static_scale(scale, device)
    m_pad = padded_rows(m, ROW_PAD)
    out = torch.empty(m_pad, hidden, dtype=torch.float8_e4m3fn, device=device)
    if scale is not None:
        return out, scale.reshape(1), (1, scale.reshape(1))
    scales = torch.empty(m_pad, 1, dtype=torch.float32, device=device)
    return out, scales, (2, scales)


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


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` whose normalised output is written as e4m3 for an FP8 GEMM:
    (q [M_pad, hidden] e4m3 with zero pad rows, its scales, x + residual [M, hidden]).
    q = e4m3(y / s) of y, the compute-dtype output ``fused_add_rms_norm`` returns; s is the
    static per-tensor ``scale`` (returned as [1]) or, with None, each row's max|y| / 448
    ([M_pad, 1], ``fp8.fp8_scale_per_token``; pad rows 1e-12). One kernel."""
    _check(x, weight)
    check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("residual", residual, tuple(x.shape))
    out, scales, fp8 = _fp8_out(x.shape[0], x.shape[1], scale, x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, out, res_out, eps, fp8=fp8)
    return out, scales, res_out


def _check_rows(rows: torch.Tensor, x: torch.Tensor) -> None:
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int32, torch.int64), device=x.device)


def embed_rms_norm(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T] (int32/int64), table [V, hidden] → (rms_norm(table[ids]) * weight,
    table[ids]): ``F.embedding`` and the first RMSNorm in one kernel. Ids outside [0, V)
    give zero rows (``F.embedding`` would raise or fault; ids are checked upstream)."""
    _check(table, weight)
    _check_rows(ids, table)
    out = torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    h = torch.empty_like(out)
    _launch(table, None, weight, out, h, eps, rows=ids)
    return out, h


def embed_rms_norm_fp8(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``embed_rms_norm`` with the normalised output as e4m3 (q [M_pad, hidden], its scales,
    table[ids]); the scales as in ``fused_add_rms_norm_fp8``."""
    _check(table, weight)
    _check_rows(ids, table)
    out, scales, fp8 = _fp8_out(ids.shape[0], table.shape[1], scale, table.device)
    h = torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    _launch(table, None, weight, out, h, eps, rows=ids, fp8=fp8)
    return out, scales, h


def gather_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """x, residual [T, hidden], rows [R] → rms_norm((x + residual)[rows]) * weight [R,
    hidden]: the last residual add, the logit rows' selection and the final norm in one
    kernel (the add is rounded to x's dtype, as the eager add is). Rows outside [0, T) give
    the norm of zeros."""
    _check(x, weight)
    check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("residual", residual, tuple(x.shape))
    _check_rows(rows, x)
    out = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, out, None, eps, rows=rows)
    return out


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager path: ``h = x + residual; rms_norm(h, w, eps)`` (residual None: h = x)."""
    h = x if residual is None else x + residual
    return _rms_norm_torch(h, weight, eps), h
