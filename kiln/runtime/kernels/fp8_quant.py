"""FP8 activation quantization for the W8A8 GEMMs (``torch._scaled_mm``, gemv's W8A8 form),
fused on the device.

``quantize_fp8_padded(x, scale)``: x [M, K] → e4m3(clamp(x / s, ±448)) written straight
into an [M_pad, K] buffer (M_pad = M rounded up to 16, pad rows zero), one launch:

- a static per-tensor ``scale`` (calibrated ``input_scale``): s is it, returned as [1];
- ``scale=None``, dynamic per token: one program per row folds max|x| over its row, takes
  s = max(amax * fp32(1 / 448), 1e-12) and quantizes the row with it; the scales come back
  as [M_pad, 1] float32 (pad rows 1e-12), ``_scaled_mm``'s row-wise ``scale_a``.

Kernels that produce an activation quantize it themselves where the next GEMM wants e4m3
(rms_norm.py, activation.py): they share ``row_scale`` and ``e4m3_value`` below, so every
path computes the same numbers. Bit-exact with the eager formulation in kiln/runtime/fp8.py
(``quantize_fp8``, ``fp8_scale_per_token``): division is IEEE (div_rn, as torch's
tensor / tensor) and the per-token scale is one float32 product with fp32(1 / 448).
No host syncs; scales never leave the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.fp8 import pad_rows, quantize_fp8, quantize_fp8_per_token
from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import FLOAT_DTYPES, check_tensor
from kiln.runtime.kernels._pdl import pdl_begin

ROW_PAD = 16  # _scaled_mm (older torch/cuBLAS) wants M % 16 == 0
ROW_BLOCK_MAX = 4096  # a per-token row is quantized in one pass up to this width


@triton.jit
def row_scale(amax):
    """A row's dynamic scale from its max |x| (float32): max(amax * fp32(1 / 448), 1e-12)."""
    return tl.maximum(amax * (1.0 / 448.0), 1e-12)


@triton.jit
def e4m3_value(x, scale):
    """clamp(x / scale, ±448) for float32 x: the value an e4m3 store rounds. IEEE division
    (a plain / on float32 is div.full.f32, up to 2 ulp off, in triton)."""
    return tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)


@triton.jit
def _quant_kernel(
    x_ptr, scale_ptr, out_ptr, M, M_PAD, K, stride_xm, stride_om,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    scale = tl.load(scale_ptr)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    c_ok = cols < K
    # pad rows (M <= row < M_pad) load nothing and store zeros
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :],
                mask=(rows < M)[:, None] & c_ok[None, :], other=0.0)
    q = e4m3_value(x.to(tl.float32), scale)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             q.to(out_ptr.dtype.element_ty), mask=(rows < M_PAD)[:, None] & c_ok[None, :])


@triton.jit
def _quant_rows_kernel(
    x_ptr, out_ptr, scale_out_ptr, M, K, stride_xm, stride_om,
    BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0)  # one row; rows >= M (the pad) read nothing: zeros, scale 1e-12
    cols = tl.arange(0, BLOCK_K)
    row_ok = (cols * 0 + t) < M  # a vector mask (the interpreter's)
    x_row = x_ptr + t.to(tl.int64) * stride_xm
    o_row = out_ptr + t.to(tl.int64) * stride_om
    if ONE_PASS:  # the row in registers
        ok = cols < K
        x = tl.load(x_row + cols, mask=ok & row_ok, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), axis=0))
        tl.store(o_row + cols, e4m3_value(x, scale).to(out_ptr.dtype.element_ty), mask=ok)
    else:  # the row's amax, then the row again (from L2)
        run = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + cols, mask=(cols + k0 < K) & row_ok, other=0.0)
            run = tl.maximum(run, tl.abs(x.to(tl.float32)))
        scale = row_scale(tl.max(run, axis=0))
        for k0 in range(0, K, BLOCK_K):
            ok = cols + k0 < K
            x = tl.load(x_row + k0 + cols, mask=ok & row_ok, other=0.0).to(tl.float32)
            tl.store(o_row + k0 + cols, e4m3_value(x, scale).to(out_ptr.dtype.element_ty),
                     mask=ok)
    tl.store(scale_out_ptr + t, scale)


def check_static_scale(scale: torch.Tensor | None, device: torch.device) -> None:
    """A static activation scale: a 0-dim or 1-element float32 tensor on ``device``."""
    if scale is None:
        return
    check_tensor("scale", scale, dtypes=(torch.float32,), device=device)
    if scale.numel() != 1:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected a per-tensor "
                         "scale (0-dim or 1 element), or None for per-token scales")


def padded_rows(m: int, row_pad: int) -> int:
    """M rounded up to ``row_pad`` (>= 1)."""
    if row_pad < 1:
        raise ValueError(f"row_pad must be >= 1, got {row_pad}")
    return -(-m // row_pad) * row_pad


def row_block(k: int) -> tuple[int, bool, int]:
    """(BLOCK_K, one pass, num_warps) of a per-token row of width ``k``."""
    block = min(ROW_BLOCK_MAX, triton.next_power_of_2(max(k, 1)))
    return block, k <= block, 4 if block <= 2048 else 8


def quantize_fp8_padded(
    x: torch.Tensor, scale: torch.Tensor | None = None, row_pad: int = ROW_PAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (xq [M_pad, K] float8_e4m3fn with zero pad rows, its scales): with a static
    per-tensor ``scale`` (0-dim or 1-element float32 on x's device) that scale as a 1-element
    view; with None the per-token scales [M_pad, 1] float32 (pad rows 1e-12)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_static_scale(scale, x.device)
    m, k = x.shape
    m_pad = padded_rows(m, row_pad)
    out = torch.empty(m_pad, k, dtype=torch.float8_e4m3fn, device=x.device)
    if scale is None:
        scales = torch.empty(m_pad, 1, dtype=torch.float32, device=x.device)
        if m_pad:
            block, one_pass, warps = row_block(k)
            _quant_rows_kernel[(m_pad,)](
                x, out, scales, m, k, x.stride(0), out.stride(0), BLOCK_K=block,
                ONE_PASS=one_pass, num_warps=warps, **_pdl.launch_kwargs(),
            )
        return out, scales
    if m_pad == 0 or k == 0:
        return out, scale.reshape(1)
    block_k = min(1024, triton.next_power_of_2(k))
    rows = max(1, min(16, 4096 // block_k))
    _quant_kernel[(triton.cdiv(m_pad, rows), triton.cdiv(k, block_k))](
        x, scale.reshape(1), out, m, m_pad, k, x.stride(0), out.stride(0),
        ROWS=rows, BLOCK_K=block_k, num_warps=4, **_pdl.launch_kwargs(),
    )
    return out, scale.reshape(1)


def quantize_fp8_padded_ref(
    x: torch.Tensor, scale: torch.Tensor | None = None, row_pad: int = ROW_PAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager formulation (kiln.runtime.fp8's quantize_fp8 / quantize_fp8_per_token) plus
    the pad rows."""
    if scale is None:
        q, s = quantize_fp8_per_token(x)
        return pad_rows(q, s, row_pad)
    q, _ = pad_rows(quantize_fp8(x, scale.float()), None, row_pad)
    return q, scale.float().reshape(1)
