"""SiLU-and-mul on the fused gate_up projection: [T, 2I] → silu(gate) * up, [T, I].

``silu_and_mul_fp8`` writes the product as e4m3 for the FP8 down projection instead, with a
static per-tensor scale or each row's own (dynamic per-token: one program per row finds the
row's max |y| of the compute-dtype product y, then quantizes the row; the shared arithmetic
is kiln/runtime/kernels/fp8_quant.py's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import FLOAT_DTYPES, check_tensor
from kiln.runtime.kernels._pdl import pdl_begin
from kiln.runtime.kernels.fp8_quant import (
    ROW_PAD,
    check_static_scale,
    e4m3_value,
    padded_rows,
    row_block,
    row_scale,
)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + offs, mask=m, other=0.0).to(tl.float32)
    # Same rounding as the eager path: silu rounded to the input dtype, then the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (act * up).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul(x_ptr, offs, m, inter):
    """silu(gate) * up at ``offs`` of a row, rounded as ``_silu_and_mul_kernel`` does (to
    x's dtype), as float32."""
    gate = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + inter + offs, mask=m, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    return (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, T, inter, stride_xt, stride_ot,
    DYNAMIC: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0)  # one row; rows >= T (the pad) read nothing: zeros, scale 1e-12
    cols = tl.arange(0, BLOCK)
    row_ok = (cols * 0 + t) < T  # a vector mask (the interpreter's)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    o_row = out_ptr + t.to(tl.int64) * stride_ot
    if ONE_PASS:  # the row in registers
        ok = cols < inter
        y = _silu_mul(x_row, cols, ok & row_ok, inter)
        if DYNAMIC:
            scale = row_scale(tl.max(tl.abs(y), axis=0))
            tl.store(scale_ptr + t, scale)
        else:
            scale = tl.load(scale_ptr)
        tl.store(o_row + cols, e4m3_value(y, scale).to(out_ptr.dtype.element_ty), mask=ok)
    else:  # dynamic: the row's max |y|, then the row again (recomputed, its loads from L2)
        if DYNAMIC:
            run = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, inter, BLOCK):
                y = _silu_mul(x_row, k0 + cols, (k0 + cols < inter) & row_ok, inter)
                run = tl.maximum(run, tl.abs(y))
            scale = row_scale(tl.max(run, axis=0))
            tl.store(scale_ptr + t, scale)
        else:
            scale = tl.load(scale_ptr)
        for k0 in range(0, inter, BLOCK):
            ok = k0 + cols < inter
            y = _silu_mul(x_row, k0 + cols, ok & row_ok, inter)
            tl.store(o_row + k0 + cols, e4m3_value(y, scale).to(out_ptr.dtype.element_ty),
                     mask=ok)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (gate then up halves) → [T, I] = silu(gate) * up, in x's dtype."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] % 2:
        raise ValueError(f"x has {x.shape[1]} columns; gate_up needs an even count (2 * I)")
    t, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(t, inter, dtype=x.dtype, device=x.device)
    check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=x.device)
    if tuple(out.shape) != (t, inter):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(t, inter)}")
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        **_pdl.launch_kwargs(),
    )
    return out


def silu_and_mul_fp8(
    x: torch.Tensor, scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2I] → (q [T_pad, I] e4m3 with zero pad rows, its scales): q = e4m3(y / s) of
    y = ``silu_and_mul(x)`` (the compute-dtype product); s is the static per-tensor
    ``scale`` (returned as [1]) or, with None, each row's max|y| / 448 ([T_pad, 1],
    ``fp8.fp8_scale_per_token``; pad rows 1e-12). One kernel, one program per row."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] % 2:
        raise ValueError(f"x has {x.shape[1]} columns; gate_up needs an even count (2 * I)")
    check_static_scale(scale, x.device)
    t, inter = x.shape[0], x.shape[1] // 2
    t_pad = padded_rows(t, ROW_PAD)
    out = torch.empty(t_pad, inter, dtype=torch.float8_e4m3fn, device=x.device)
    if scale is None:
        scales = torch.empty(t_pad, 1, dtype=torch.float32, device=x.device)
    else:
        scales = scale.reshape(1)
    if t_pad == 0:
        return out, scales
    block, one_pass, warps = row_block(inter)
    _silu_and_mul_fp8_kernel[(t_pad,)](
        x, out, scales, t, inter, x.stride(0), out.stride(0), DYNAMIC=scale is None,
        BLOCK=block, ONE_PASS=one_pass, num_warps=warps, **_pdl.launch_kwargs(),
    )
    return out, scales


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The eager formulation in kiln/runtime/models/llama.py."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
