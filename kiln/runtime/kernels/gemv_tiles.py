"""The skinny GEMM's tile operations: what one program of kiln/runtime/kernels/gemv_kernel.py
does with one tile (``@triton.jit`` device functions, inlined into the kernel).

The loads that fuse a prologue into the GEMV (SiLU-and-mul of a gate | up row, the add +
RMSNorm, the RMSNorm of a residual whose statistics come in partial sums), the stores that
fuse an epilogue (scale and bias, the residual add with its sum of squares) and the L2
prefetch of weight tiles. Each keeps the rounding points of the unfused kernels it replaces
(activation.py, rms_norm.py), named in its docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.runtime.kernels._pdl import prefetch_l2


@triton.jit
def _scaled(v, scale_ptr, rows, HAS_SCALE: tl.constexpr):
    """v times the weight scale: one per tensor (``HAS_SCALE == 1``) or one per output row
    (``HAS_SCALE == 2``, loaded at ``rows``, valid row indices shaped to broadcast with v)."""
    if HAS_SCALE == 2:
        v = v * tl.load(scale_ptr + rows)
    elif HAS_SCALE:
        v = v * tl.load(scale_ptr)
    return v


@triton.jit
def _store_row(
    v, row, pid_k, offs_n, rows_n, M, N, y_ptr, part_ptr, scale_ptr, bias_ptr, stride_ym,
    SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, RND: tl.constexpr,
):
    """Row ``row`` of the output, v [BLOCK_N] float32: a split-K partial, or scaled + bias,
    rounded to ``RND`` (x's dtype) before y's dtype (float32 y: the widened x-dtype result)."""
    n_ok = offs_n < N
    if SPLIT:
        tl.store(part_ptr + (pid_k * M + row) * N + offs_n, v, mask=n_ok)
    else:
        v = _scaled(v, scale_ptr, rows_n, HAS_SCALE)
        if HAS_BIAS:
            v += tl.load(bias_ptr + rows_n).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + offs_n, v.to(RND).to(y_ptr.dtype.element_ty),
                 mask=n_ok)


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in float32 with activation.py's rounding (silu rounded to ``dtype``,
    then the product), rounded to ``dtype``: the value ``silu_and_mul`` would have stored."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(dtype)


@triton.jit
def _load_x(x_ptrs, K, mask, ACT: tl.constexpr):
    """An x tile; with ACT, x holds [gate | up] (2K columns) and the tile is silu(g) * up."""
    if ACT:
        g = tl.load(x_ptrs, mask=mask, other=0.0)
        u = tl.load(x_ptrs + K, mask=mask, other=0.0)
        return _silu_mul(g, u, g.dtype)
    return tl.load(x_ptrs, mask=mask, other=0.0)


@triton.jit
def _norm_tile(x_ptrs, r_ptrs, g_ptrs, k_ok, inv, EVEN_K: tl.constexpr):
    """rms_norm(x + residual) * g on one K tile, in rms_norm.py's rounding: the sum rounded
    to x's dtype, normalised in float32 and rounded, then times the weight and rounded."""
    if EVEN_K:
        a = tl.load(x_ptrs)
        r = tl.load(r_ptrs)
        g = tl.load(g_ptrs)
    else:
        a = tl.load(x_ptrs, mask=k_ok, other=0.0)
        r = tl.load(r_ptrs, mask=k_ok, other=0.0)
        g = tl.load(g_ptrs, mask=k_ok, other=0.0)
    h = (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype).to(tl.float32)
    return ((h * inv).to(a.dtype).to(tl.float32) * g.to(tl.float32)).to(a.dtype)


@triton.jit
def _prenorm_tile(x_ptrs, g_ptrs, k_ok, inv, EVEN_K: tl.constexpr):
    """rms_norm(h) * g on one K tile, h's statistics given (inv), in rms_norm.py's rounding:
    normalised in float32 and rounded, then times the weight and rounded."""
    if EVEN_K:
        h = tl.load(x_ptrs)
        g = tl.load(g_ptrs)
    else:
        h = tl.load(x_ptrs, mask=k_ok, other=0.0)
        g = tl.load(g_ptrs, mask=k_ok, other=0.0)
    return ((h.to(tl.float32) * inv).to(h.dtype).to(tl.float32) * g.to(tl.float32)).to(h.dtype)


@triton.jit
def _store_residual(v, res_tile, pid_n, offs_n, rows_n, N, res_out_ptr, ss_ptr, scale_ptr,
                    bias_ptr, g_ptr, hg_ptr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HG: tl.constexpr):
    """One row: h = y + residual on this program's output tile, in fused_add_rms_norm's
    rounding (y rounded, the sum rounded), stored as the new residual; and sum(h^2) over the
    tile, the partial the next GEMV's PRENORM sums. With ``HG``, also h * g (the next
    RMSNorm's weight, rounded once): the input of the epilogue-normed GEMV (PRENORM == 2)."""
    n_ok = offs_n < N
    v = _scaled(v, scale_ptr, rows_n, HAS_SCALE)
    if HAS_BIAS:
        v += tl.load(bias_ptr + rows_n).to(tl.float32)
    dt = res_out_ptr.dtype.element_ty
    h = (v.to(dt).to(tl.float32) + res_tile.to(tl.float32)).to(dt)
    tl.store(res_out_ptr + offs_n, h, mask=n_ok)
    hf = tl.where(n_ok, h.to(tl.float32), 0.0)
    tl.store(ss_ptr + pid_n, tl.sum(hf * hf, axis=0))
    if HG:
        gv = tl.load(g_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(hg_ptr + offs_n, (hf * gv).to(dt), mask=n_ok)


@triton.jit
def _fma_row(acc, w, x_ptrs, row, stride_xm, k_ok, K, EVEN_K: tl.constexpr, ACT: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] += w (float32) * x[row, k-tile] (broadcast over the N rows)."""
    p = x_ptrs + row * stride_xm
    if EVEN_K:
        xv = tl.load(p)
        if ACT:
            xv = _silu_mul(xv, tl.load(p + K), xv.dtype)
    else:
        xv = tl.load(p, mask=k_ok, other=0.0)
        if ACT:
            xv = _silu_mul(xv, tl.load(p + K, mask=k_ok, other=0.0), xv.dtype)
    return acc + w * xv.to(tl.float32)[None, :]


@triton.jit
def _prefetch_slice(w_ptr, rows_n, stride_wn, k_lo, k_hi, STEP: tl.constexpr):
    """L2-prefetch W[rows_n, k_lo:k_hi], one hint per STEP elements (PREFETCH_HINT_BYTES)."""
    cols = tl.arange(0, 32) * STEP
    for k in range(k_lo, k_hi, 32 * STEP):
        prefetch_l2(w_ptr + rows_n[:, None] * stride_wn + (k + cols)[None, :],
                     tl.broadcast_to((k + cols < k_hi)[None, :], (rows_n.shape[0], 32)))
