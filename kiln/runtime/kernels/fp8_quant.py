"""FP8 activation quantization for the W8A8 ``torch._scaled_mm`` path, fused on the device.

``quantize_fp8_padded(x, scale)``: x [M, K] → e4m3(clamp(x / scale, ±448)) written straight
into an [M_pad, K] buffer (M_pad = M rounded up to 16, pad rows zero), one launch.
With ``scale=None`` (dynamic per-tensor scale) an amax kernel first folds max|x| into a
float32 device scalar (atomic max), and the quant kernel derives the scale from it
(amax / 448, floored at 1e-12) and also writes it out for ``_scaled_mm``'s ``scale_a``.

Bit-exact with the eager CUDA formulation in kiln/runtime/fp8.py
(``quantize_fp8(x, fp8_scale(x))``): division is IEEE (div_rn, as torch's tensor / tensor) and the
amax / 448 uses the float32 reciprocal of 448, as torch does for a tensor / Python scalar.
No host syncs; the scale never leaves the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.fp8 import fp8_scale, quantize_fp8
from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import FLOAT_DTYPES, check_tensor
from kiln.runtime.kernels._pdl import pdl_begin

FP8_MAX = 448.0
SCALE_MIN = 1e-12
ROW_PAD = 16  # _scaled_mm (older torch/cuBLAS) wants M % 16 == 0


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, M, K, stride_xm, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_begin(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r_ok = rows < M
    cols = tl.arange(0, BLOCK_K)
    run = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = r_ok[:, None] & (cols[None, :] + k0 < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (cols + k0)[None, :], mask=ok, other=0.0)
        run = tl.maximum(run, tl.abs(x.to(tl.float32)))
    tl.atomic_max(amax_ptr, tl.max(tl.max(run, axis=1), axis=0))


@triton.jit
def _quant_kernel(
    x_ptr, scale_ptr, out_ptr, scale_out_ptr, M, M_PAD, K, stride_xm, stride_om,
    DYNAMIC: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    if DYNAMIC:  # scale_ptr holds amax; torch computes amax / 448.0 as amax * fp32(1 / 448)
        scale = tl.maximum(tl.load(scale_ptr) * (1.0 / 448.0), 1e-12)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_out_ptr, scale)
    else:
        scale = tl.load(scale_ptr)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    c_ok = cols < K
    # pad rows (M <= row < M_pad) load nothing and store zeros
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :],
                mask=(rows < M)[:, None] & c_ok[None, :], other=0.0)
    # IEEE division (a plain / on float32 is div.full.f32, up to 2 ulp off, in triton)
    q = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             q.to(out_ptr.dtype.element_ty), mask=(rows < M_PAD)[:, None] & c_ok[None, :])


def quantize_fp8_padded(
    x: torch.Tensor, scale: torch.Tensor | None = None, row_pad: int = ROW_PAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (xq [M_pad, K] float8_e4m3fn with zero pad rows, scale as a 1-element
    float32 device tensor). ``scale``: static per-tensor scale (0-dim or 1-element float32
    tensor on x's device, returned as a 1-element view); None = dynamic (amax(|x|) / 448, >= 1e-12)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if scale is not None:
        check_tensor("scale", scale, dtypes=(torch.float32,), device=x.device)
        if scale.numel() != 1:
            raise ValueError(f"scale has shape {tuple(scale.shape)}; expected a per-tensor "
                             "scale (0-dim or 1 element)")
    if row_pad < 1:
        raise ValueError(f"row_pad must be >= 1, got {row_pad}")
    m, k = x.shape
    m_pad = -(-m // row_pad) * row_pad
    out = torch.empty(m_pad, k, dtype=torch.float8_e4m3fn, device=x.device)
    if m_pad == 0 or k == 0:
        if scale is None:
            return out, torch.full((1,), SCALE_MIN, dtype=torch.float32, device=x.device)
        return out, scale.reshape(1)
    block_k = min(1024, triton.next_power_of_2(k))
    rows = max(1, min(16, 4096 // block_k))
    if scale is None:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        if m:
            # about 2 programs per SM, each folding a [rows, K] slab, one atomic each
            arows = min(64, triton.next_power_of_2(triton.cdiv(m, 264)))
            _amax_kernel[(triton.cdiv(m, arows),)](
                x, amax, m, k, x.stride(0), ROWS=arows,
                BLOCK_K=min(block_k, max(16, 4096 // arows)), num_warps=4,
                **_pdl.launch_kwargs(),
            )
        scale_out = torch.empty(1, dtype=torch.float32, device=x.device)
        src, dynamic = amax, True
    else:
        src = scale_out = scale.reshape(1)
        dynamic = False
    _quant_kernel[(triton.cdiv(m_pad, rows), triton.cdiv(k, block_k))](
        x, src, out, scale_out, m, m_pad, k, x.stride(0), out.stride(0),
        DYNAMIC=dynamic, ROWS=rows, BLOCK_K=block_k, num_warps=4, **_pdl.launch_kwargs(),
    )
    return out, scale_out


def quantize_fp8_padded_ref(
    x: torch.Tensor, scale: torch.Tensor | None = None, row_pad: int = ROW_PAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager formulation (kiln.runtime.fp8's quantize_fp8 / fp8_scale) plus zero pad
    rows."""
    s = fp8_scale(x) if scale is None else scale.float()
    q = quantize_fp8(x, s)
    pad = -x.shape[0] % row_pad
    q = torch.cat([q.view(torch.uint8),
                   torch.zeros(pad, x.shape[1], dtype=torch.uint8, device=x.device)])
    return q.view(torch.float8_e4m3fn), s.reshape(1)
