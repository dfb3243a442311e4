"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for 1 <= M <= GEMM_MAX_M.

W is row-major [N, K] like ``F.linear``'s weight: bf16/fp16 (the input dtype), or FP8 e4m3
with a float32 ``weight_scale``, per tensor or one per row (the FP8 lm_head) (W8A16:
activations stay bf16/fp16, weights are widened in registers, float32 accumulation, the
scale applied once per output). At batch 1
the whole cost is streaming W once, so the kernel is about bytes in flight:

- ``USE_DOT=False`` (CUDA cores): a program owns BLOCK_N rows of W; each loop step loads a
  [BLOCK_N, BLOCK_K] tile, widens it to float32 once and accumulates w * x[m] elementwise
  into one float32 [BLOCK_N, BLOCK_K] register tile per row m (the M rows are unrolled),
  reduced over K once at the end (no shuffles in the loop).
- ``USE_DOT=True`` (tensor cores, "swap AB"): acc[BLOCK_N, 16] += W_tile @ x_tile^T with
  the M rows padded to 16 by masking (masked lanes read no memory); Triton pipelines the
  W tiles through shared memory ``num_stages`` deep.
- ``SPLIT_K > 1``: program (n, s) covers K slice s and writes a float32 partial
  [SPLIT_K, M, N]; ``_splitk_reduce_kernel`` sums the slices in a fixed order (deterministic),
  applies scale and bias and casts. Worth its second launch only where N is small.

``gemv_add_rms_norm`` (one row, CUDA-core tiles): x is the addend of a residual stream; every
program computes rms_norm(x + residual) itself and normalises each x tile as it loads it, and
program (0, 0) writes the new residual: the add + RMSNorm kernel before the projection is
gone (where it measured faster: K <= ``NORM_PROLOGUE_MAX_K``).

Everything stays on the device (graph-safe): no host syncs, the scale is read by the kernel,
the split-K workspace size depends on the shapes only. Configs are dicts (``GEMV_CONFIGS``);
``gemv(config=None)`` asks ``kiln.runtime.kernels.tuning.lookup("gemv", key)`` first (a
build-time tuned table, when that module exists) and falls back to ``default_config``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kiln.runtime import env
from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import FP8_DTYPES, check_shape, check_tensor
from kiln.runtime.kernels._pdl import pdl_begin, prefetch_l2

GEMV_MAX_M = 8  # rows of the CUDA-core tiles (unrolled) and of the W8A8 form
# Tensor-core tiles take up to GEMM_MAX_M rows, BLOCK_M = 16 per program (grid axis 2): the
# speculative steps' 9-128-token batches on small weights, where cuBLAS is launch-bound and,
# not being a PDL kernel, a full barrier in the chain. ``gemv_wins`` does not route them here:
# on the H200 (smollm2, lookahead (7,7,7)) they were no faster than cuBLAS end to end.
GEMM_MAX_M = 128
GEMV_DTYPES = (torch.bfloat16, torch.float16)
W8A8 = "w8a8"  # the tuning-table dtype of W8A8 launches (e4m3 x)
CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "USE_DOT", "num_warps", "num_stages")


def _cfg(bn: int, bk: int, dot: bool, warps: int = 4, stages: int = 1, split: int = 1) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "USE_DOT": dot,
            "num_warps": warps, "num_stages": stages}


# Candidates a build-time tuner tries per shape (SPLIT_K is tried on top of these: see
# ``split_candidates``). CUDA-core tiles first, then tensor-core tiles.
GEMV_CONFIGS: list[dict] = [
    _cfg(4, 512, False),
    _cfg(8, 512, False),
    _cfg(4, 1024, False, warps=8),
    _cfg(8, 1024, False, warps=8),
    _cfg(16, 256, False),
    _cfg(4, 256, False),
    _cfg(16, 512, False),
    _cfg(16, 1024, False, warps=8),
    _cfg(8, 2048, False, warps=8),
    _cfg(16, 256, True, stages=4),
    _cfg(32, 256, True, stages=4),
    _cfg(64, 128, True, stages=4),
    _cfg(64, 256, True, warps=8, stages=3),
    _cfg(128, 128, True, warps=8, stages=3),
]


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


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, xs_ptr,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr,
    ACT: tl.constexpr, X_FP8: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    ESIZE: tl.constexpr, res_ptr, g_ptr, res_out_ptr, eps, NORM: tl.constexpr,
    K_PAD: tl.constexpr, HINT: tl.constexpr, W_EVICT: tl.constexpr,
    ss_ptr, hg_ptr, n_part, RES_EPI: tl.constexpr, PRENORM: tl.constexpr,
    NPART_PAD: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N re-read row offs_n % N (valid memory, no mask in the loop) and are not stored
    rows_n = (offs_n % N).to(tl.int64)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if USE_DOT:
        # x^T tile [BLOCK_K, BLOCK_M] (BLOCK_M = 16, rows >= M masked: no memory read);
        # acc [BLOCK_N, BLOCK_M] = W_tile @ x_tile^T ("swap AB")
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        pdl_begin(PDL)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kk in range(0, K_SPLIT, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy=W_EVICT)
                xt = _load_x(x_ptrs, K, m_ok[None, :], ACT)
            else:
                k_ok = offs_k + kk < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy=W_EVICT)
                xt = _load_x(x_ptrs, K, m_ok[None, :] & k_ok[:, None], ACT)
            if WIDEN:  # the CPU interpreter's bf16 dot is wrong; same numbers in float32
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(w.to(xt.dtype), xt, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out_ok = (offs_n[:, None] < N) & m_ok[None, :]
        if SPLIT:
            p_ptrs = part_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None]
            tl.store(p_ptrs, acc, mask=out_ok)
        else:
            acc = _scaled(acc, scale_ptr, rows_n[:, None], HAS_SCALE)
            if X_FP8:
                acc = acc * tl.load(xs_ptr)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows_n).to(tl.float32)[:, None]
            y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
            if not X_FP8:  # float32 y: the x-dtype result, widened
                acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        # CUDA cores, BLOCK_M = M rows unrolled: one [BLOCK_N, BLOCK_K] float32 accumulator
        # per row, the widened W tile shared by all rows; reduced over K once at the end
        x_ptrs = x_ptr + offs_k
        if PREFETCH:  # the first two W tiles into L2 before the PDL wait (no kernel writes W)
            k_lo = pid_k * K_SPLIT
            _prefetch_slice(w_ptr, rows_n, stride_wn, k_lo,
                            tl.minimum(K, k_lo + tl.minimum(K_SPLIT, 2 * BLOCK_K)), HINT // ESIZE)
        pdl_begin(PDL)
        if NORM:  # one row: x is an addend, the input is rms_norm(x + residual) * g
            ka = tl.arange(0, K_PAD)
            ka_ok = ka < K
            h = (tl.load(x_ptr + ka, mask=ka_ok, other=0.0).to(tl.float32)
                 + tl.load(res_ptr + ka, mask=ka_ok, other=0.0).to(tl.float32))
            h = h.to(x_ptr.dtype.element_ty)
            if (pid_n == 0) & (pid_k == 0):  # the new residual, written once
                tl.store(res_out_ptr + ka, h, mask=ka_ok)
            hf = h.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / K + eps)
            r_ptrs = res_ptr + offs_k
            g_ptrs = g_ptr + offs_k
        if PRENORM == 1:  # one row: x is the new residual h, the input is rms_norm(h) * g,
            # with sum(h^2) from the partial sums the producing GEMV wrote (ss_ptr, n_part)
            pp = tl.arange(0, NPART_PAD)
            ss = tl.sum(tl.load(ss_ptr + pp, mask=pp < n_part, other=0.0), axis=0)
            inv = 1.0 / tl.sqrt(ss / K + eps)
            g_ptrs = g_ptr + offs_k
        if RES_EPI == 1:  # one row: the residual tile this program adds to its outputs
            res_tile = tl.load(res_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if BLOCK_M > 1:
            acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if BLOCK_M > 2:
            acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if BLOCK_M > 3:
            acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if BLOCK_M > 4:
            acc4 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if BLOCK_M > 5:
            acc5 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if BLOCK_M > 6:
            acc6 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if BLOCK_M > 7:
            acc7 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for kk in range(0, K_SPLIT, BLOCK_K):
            k_ok = offs_k + kk < K
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy=W_EVICT).to(tl.float32)
            else:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0,
                            eviction_policy=W_EVICT).to(tl.float32)
            if NORM:
                xv = _norm_tile(x_ptrs, r_ptrs, g_ptrs, k_ok, inv, EVEN_K)
                acc0 += w * xv.to(tl.float32)[None, :]
                r_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
            elif PRENORM == 1:
                xv = _prenorm_tile(x_ptrs, g_ptrs, k_ok, inv, EVEN_K)
                acc0 += w * xv.to(tl.float32)[None, :]
                g_ptrs += BLOCK_K
            else:
                acc0 = _fma_row(acc0, w, x_ptrs, 0, stride_xm, k_ok, K, EVEN_K, ACT)
            if BLOCK_M > 1:
                acc1 = _fma_row(acc1, w, x_ptrs, 1, stride_xm, k_ok, K, EVEN_K, ACT)
            if BLOCK_M > 2:
                acc2 = _fma_row(acc2, w, x_ptrs, 2, stride_xm, k_ok, K, EVEN_K, ACT)
            if BLOCK_M > 3:
                acc3 = _fma_row(acc3, w, x_ptrs, 3, stride_xm, k_ok, K, EVEN_K, ACT)
            if BLOCK_M > 4:
                acc4 = _fma_row(acc4, w, x_ptrs, 4, stride_xm, k_ok, K, EVEN_K, ACT)
            if BLOCK_M > 5:
                acc5 = _fma_row(acc5, w, x_ptrs, 5, stride_xm, k_ok, K, EVEN_K, ACT)
            if BLOCK_M > 6:
                acc6 = _fma_row(acc6, w, x_ptrs, 6, stride_xm, k_ok, K, EVEN_K, ACT)
            if BLOCK_M > 7:
                acc7 = _fma_row(acc7, w, x_ptrs, 7, stride_xm, k_ok, K, EVEN_K, ACT)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        v0 = tl.sum(acc0, axis=1)
        if PRENORM == 2:  # one row: x is h * g, the product is scaled by 1 / rms(h) here,
            # sum(h^2) from the producing GEMV's partials, read after the loop (no register
            # is held across it: the loop is the plain GEMV's)
            pp = tl.arange(0, NPART_PAD)
            ss = tl.sum(tl.load(ss_ptr + pp, mask=pp < n_part, other=0.0), axis=0)
            v0 = v0 * (1.0 / tl.sqrt(ss / K + eps))
        if RES_EPI == 2:  # loaded after the loop: held across it, the tile cost 8B's
            # 8-warp producers 64 -> 78 registers (4 -> 3 programs per SM)
            res_tile = tl.load(res_ptr + offs_n, mask=offs_n < N, other=0.0)
        if RES_EPI:
            _store_residual(v0, res_tile, pid_n, offs_n, rows_n, N, res_out_ptr, ss_ptr,
                            scale_ptr, bias_ptr, g_ptr, hg_ptr, HAS_SCALE, HAS_BIAS,
                            RES_EPI == 2)
        else:
            _store_row(v0, 0, pid_k, offs_n, rows_n, M, N, y_ptr, part_ptr,
                       scale_ptr, bias_ptr, stride_ym, SPLIT, HAS_SCALE, HAS_BIAS,
                       x_ptr.dtype.element_ty)
        if BLOCK_M > 1:
            _store_row(tl.sum(acc1, axis=1), 1, pid_k, offs_n, rows_n, M, N, y_ptr, part_ptr,
                       scale_ptr, bias_ptr, stride_ym, SPLIT, HAS_SCALE, HAS_BIAS,
                       x_ptr.dtype.element_ty)
        if BLOCK_M > 2:
            _store_row(tl.sum(acc2, axis=1), 2, pid_k, offs_n, rows_n, M, N, y_ptr, part_ptr,
                       scale_ptr, bias_ptr, stride_ym, SPLIT, HAS_SCALE, HAS_BIAS,
                       x_ptr.dtype.element_ty)
        if BLOCK_M > 3:
            _store_row(tl.sum(acc3, axis=1), 3, pid_k, offs_n, rows_n, M, N, y_ptr, part_ptr,
                       scale_ptr, bias_ptr, stride_ym, SPLIT, HAS_SCALE, HAS_BIAS,
                       x_ptr.dtype.element_ty)
        if BLOCK_M > 4:
            _store_row(tl.sum(acc4, axis=1), 4, pid_k, offs_n, rows_n, M, N, y_ptr, part_ptr,
                       scale_ptr, bias_ptr, stride_ym, SPLIT, HAS_SCALE, HAS_BIAS,
                       x_ptr.dtype.element_ty)
        if BLOCK_M > 5:
            _store_row(tl.sum(acc5, axis=1), 5, pid_k, offs_n, rows_n, M, N, y_ptr, part_ptr,
                       scale_ptr, bias_ptr, stride_ym, SPLIT, HAS_SCALE, HAS_BIAS,
                       x_ptr.dtype.element_ty)
        if BLOCK_M > 6:
            _store_row(tl.sum(acc6, axis=1), 6, pid_k, offs_n, rows_n, M, N, y_ptr, part_ptr,
                       scale_ptr, bias_ptr, stride_ym, SPLIT, HAS_SCALE, HAS_BIAS,
                       x_ptr.dtype.element_ty)
        if BLOCK_M > 7:
            _store_row(tl.sum(acc7, axis=1), 7, pid_k, offs_n, rows_n, M, N, y_ptr, part_ptr,
                       scale_ptr, bias_ptr, stride_ym, SPLIT, HAS_SCALE, HAS_BIAS,
                       x_ptr.dtype.element_ty)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr, scale_ptr, bias_ptr, y_ptr, xs_ptr, x_ptr, M, N, stride_ym,
    SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    X_FP8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    acc = _scaled(acc, scale_ptr, tl.where(ok, offs, 0), HAS_SCALE)
    if X_FP8:
        acc = acc * tl.load(xs_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if not X_FP8:  # float32 y: the x-dtype result, widened (x_ptr: only its dtype is used)
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def tuning_key(m: int, n: int, k: int, dtype: torch.dtype | str) -> str:
    """The key of one shape in the tuning table: ``"{m}x{n}x{k}:{fp8|w8a8|bfloat16|float16}"``
    (``dtype`` is the weight dtype, any FP8 weight is ``fp8``; ``W8A8`` for e4m3 x)."""
    if isinstance(dtype, torch.dtype):
        dtype = "fp8" if dtype in FP8_DTYPES else str(dtype).removeprefix("torch.")
    return f"{m}x{n}x{k}:{dtype}"


@functools.lru_cache(maxsize=1024)
def default_config(m: int, n: int, k: int, fp8: bool) -> dict:
    """The measured best rule (per-shape sweeps against cuBLAS; docs/decisions.md).

    M = 1: CUDA cores everywhere (tensor-core tiles never won, except bf16 wide-and-shallow).
    M >= 2: tensor cores, except small weights at M = 2 (and FP8 up to M = 4), where the
    unrolled CUDA-core rows still win. FP8 tensor-core tiles split K 4 ways: widening e4m3
    to bf16 for the dot costs ALU time, so they need more programs in flight.
    """
    small_k, wide = k <= 2048, n >= 16384
    if m > GEMV_MAX_M:  # tensor-core tiles only (CUDA-core rows are unrolled up to 8)
        cfg = _cfg(64, 128, True, stages=4)
    elif m == 1:
        if wide:  # gate_up, lm_head
            cfg = (_cfg(64, 128, True, stages=4) if k < 1024 and not fp8
                   else _cfg(16, 256, False))
        elif small_k:  # smollm2-sized: one or two K tiles, latency bound
            cfg = _cfg(4, 1024, False, warps=8) if n <= 2048 else _cfg(8, 1024, False, warps=8)
        elif n <= 4096:  # o_proj, down
            cfg = _cfg(8, 1024, False, warps=8) if fp8 else _cfg(16, 1024, False, warps=8)
        else:  # qkv
            cfg = _cfg(8, 512, False)
    elif small_k and not wide:
        if n <= 2048 and (m == 2 or (fp8 and m <= 4)):
            cfg = _cfg(4, 1024, False, warps=8)
        elif fp8 and m == 2:
            cfg = _cfg(8, 512, False)
        else:
            cfg = _cfg(32, 256, True, stages=4) if fp8 else _cfg(64, 128, True, stages=4)
    elif fp8:
        if m == 2 and n <= 8192:
            cfg = _cfg(8, 512, False)
        elif wide:
            cfg = _cfg(128, 128, True, warps=8, stages=3)
        else:
            cfg = _cfg(64, 128, True, stages=4)
    else:
        cfg = _cfg(64, 128, True, stages=4) if wide else _cfg(32, 256, True, stages=4)
    blocks = triton.cdiv(n, cfg["BLOCK_N"])
    split = 1
    if blocks < 64 and k >= 1024:  # too few programs to fill 132 SMs
        split = min(8, triton.cdiv(132, blocks), k // cfg["BLOCK_K"])
    elif fp8 and cfg["USE_DOT"] and blocks < 256 and k >= 8 * cfg["BLOCK_K"]:
        split = 4
    if split > 1:
        cfg = dict(cfg, SPLIT_K=1 << (split.bit_length() - 1))
    return cfg


# W8A8 (e4m3 x) tensor-core tiles: 64 x 128, 4 stages won at every llama-3-8b shape at M 1
# and 8 (gate_up at M = 8: 128 x 128); SPLIT_K is tried on top (``split_candidates``).
W8A8_CONFIGS: list[dict] = [
    _cfg(64, 128, True, stages=4),
    _cfg(128, 128, True, stages=4),
    _cfg(128, 256, True, warps=8, stages=3),
]


@functools.lru_cache(maxsize=1024)
def w8a8_config(m: int, n: int, k: int) -> dict:
    """The W8A8 default (the measured winners): 64 x 128 tiles, K split 4 ways while the
    weight has fewer than 256 row tiles (qkv, o_proj, down), whole K for gate_up."""
    cfg = _cfg(64, 128, True, stages=4)
    split = 4 if triton.cdiv(n, 64) < 256 and k >= 4 * 128 else 1
    return dict(cfg, SPLIT_K=split)


def w8a8_wins(m: int, n: int, k: int) -> bool:
    """Whether fp8_linear's W8A8 GEMM runs here (gemv with e4m3 x) rather than _scaled_mm.
    Measured after the same quant kernel: faster on llama-3-8b's gate_up and down at M 1-8 (36.6 vs
    38.9 and 24.9 vs 26.1 us at M = 8),
    0.1-0.7 us slower on qkv and o_proj, so weights of at least 32 M elements only. At M = 1
    the W8A16 gemv runs instead (linear() never reaches fp8_linear there)."""
    return 1 <= m <= GEMV_MAX_M and n * k >= 32 << 20


def gemv_wins(m: int, n: int, k: int, fp8: bool) -> bool:
    """Whether ``gemv`` beat cuBLAS (F.linear, or _scaled_mm after the fused activation quant
    for FP8) at this shape (linear() routes small batches by it).

    bf16/fp16: everywhere but wide-and-shallow (K < 1024, N >= 16384: smollm2's lm_head,
    where cuBLAS is ~5 % faster). FP8: always at M = 1 (W8A16 streams half the bytes of
    bf16 with no activation quant); at M >= 2 only up to 4096 x 4096 weights: beyond that
    W8A8 on the FP8 tensor cores wins (widening e4m3 in registers costs ALU time at M > 1).
    """
    if not 1 <= m <= GEMV_MAX_M:
        return False
    if fp8:
        return m == 1 or n * k <= 16 << 20
    return not (k < 1024 and n >= 16384)


# The SiLU-and-mul prologue (gemv(silu_and_mul=True)) pays where the down projection is
# short, and on FP8 weights at batch 1: smollm2 (K 1536) gains ~40 us per decode step, while
# llama-3-8b (K 14336) bf16 loses (every program recomputes the activation: N / BLOCK_N
# times). Under PDL the 8B FP8 batch-1 replay went 2.814 -> 2.751 ms with it, while 8B bf16 lost at
# batch 1 (4.191 ->
# 4.228) and both lost at batch 8 (FP8 4.102 -> 4.209, bf16 4.810 -> 7.679).
SILU_FUSION_MAX_K = 4096


def silu_fusion_applies(m: int, k: int, fp8: bool) -> bool:
    """Whether linear(silu_and_mul=True) folds the activation into the GEMV's loads: K (the
    down projection's input width) at most SILU_FUSION_MAX_K, or FP8 weights at one row."""
    return k <= SILU_FUSION_MAX_K or (fp8 and m == 1)


def split_candidates(n: int, k: int, cfg: dict) -> list[int]:
    """SPLIT_K values worth timing for ``cfg`` at N x K: 1, and more while programs are few."""
    out = [1]
    blocks = triton.cdiv(n, cfg["BLOCK_N"])
    for s in (2, 4, 8):
        if blocks * s <= 8 * 132 and k >= s * cfg["BLOCK_K"]:
            out.append(s)
    return out


_TUNING: object = None  # the tuning module once imported; False when it does not exist


def _tuned(key: str) -> dict | None:
    global _TUNING
    if _TUNING is None:
        try:
            from kiln.runtime.kernels import tuning
        except ImportError:
            tuning = False
        _TUNING = tuning
    return _TUNING.lookup("gemv", key) if _TUNING else None


def check_config(cfg: dict) -> dict:
    """Validate a config dict (keys ``CONFIG_KEYS``; missing SPLIT_K/num_stages default to 1)."""
    if not isinstance(cfg, dict):
        raise TypeError(f"config must be a dict with keys {CONFIG_KEYS}, got {cfg!r}")
    cfg = {"SPLIT_K": 1, "num_stages": 1, "USE_DOT": False, "num_warps": 4, **cfg}
    unknown = set(cfg) - set(CONFIG_KEYS)
    if unknown or "BLOCK_N" not in cfg or "BLOCK_K" not in cfg:
        raise ValueError(f"config {cfg} must have BLOCK_N and BLOCK_K and only {CONFIG_KEYS}")
    for name in ("BLOCK_N", "BLOCK_K", "num_warps"):
        v = cfg[name]
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"config {name}={v!r} must be a power of two")
    if not isinstance(cfg["SPLIT_K"], int) or cfg["SPLIT_K"] < 1:
        raise ValueError(f"config SPLIT_K={cfg['SPLIT_K']!r} must be an int >= 1")
    if cfg["USE_DOT"] and min(cfg["BLOCK_N"], cfg["BLOCK_K"]) < 16:
        raise ValueError(f"config {cfg}: USE_DOT needs BLOCK_N and BLOCK_K >= 16")
    return cfg


def gemv(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, *, config: dict | None = None,
    silu_and_mul: bool = False, x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (weight [N, K] * weight_scale)^T + bias, in x's dtype, or with
    ``out_dtype=torch.float32`` that x-dtype result widened to float32 (``.float()`` of it,
    without the extra kernel: the logits of the output projection).

    x: bf16/fp16, 1 <= M <= GEMM_MAX_M rows (row stride free, last dim contiguous); past
    GEMV_MAX_M rows only tensor-core configs (the default there).
    weight: x's dtype, or float8_e4m3fn with ``weight_scale`` a float32 tensor on x's device,
    0-dim or 1 element (per tensor) or [N] (per row) (required for FP8, refused otherwise).
    bias: [N] in x's dtype.
    ``silu_and_mul``: x is a gate_up output [M, 2K] and the product uses
    ``activation.silu_and_mul(x)`` [M, K], computed as the tiles are loaded (one kernel for
    the activation and the down projection).
    W8A8: x already e4m3 (``quantize_fp8_padded``'s output, rows past M unread) with its
    per-tensor ``x_scale`` and FP8 weights: the FP8 tensor cores' product, scaled by
    weight_scale * x_scale, returned in ``out_dtype`` (bf16/fp16, default bf16):
    ``_scaled_mm``'s function for the small M where it is faster (``w8a8_wins``);
    tensor-core configs only.
    """
    if x_scale is not None:
        return _gemv_w8a8(x, weight, weight_scale, bias, x_scale, config,
                          out_dtype or torch.bfloat16)
    m, k = _check_x(x, silu_and_mul)
    n, fp8 = _check_weight(x, weight, weight_scale, bias, k)
    if not 1 <= m <= GEMM_MAX_M:
        raise ValueError(f"x has {m} rows; gemv takes 1 to {GEMM_MAX_M} (use F.linear)")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype {out_dtype}: gemv returns x's dtype ({x.dtype}) or "
                         "float32")
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if n == 0 or k == 0:
        return y.zero_()
    config = _config(config, m, n, k, weight.dtype)
    if m > GEMV_MAX_M and not config["USE_DOT"]:
        raise ValueError(f"x has {m} rows; CUDA-core configs (USE_DOT=False) take at most "
                         f"{GEMV_MAX_M}: use a tensor-core config (got {config})")
    _launch(x, weight, weight_scale if fp8 else None, bias, y, None, config, silu_and_mul)
    return y


def _check_x(x: torch.Tensor, silu_and_mul: bool) -> tuple[int, int]:
    """(M, K) of a bf16/fp16 x [M, K], or of x = gate | up [M, 2K] with ``silu_and_mul``."""
    check_tensor("x", x, ndim=2, dtypes=GEMV_DTYPES)
    m, k = x.shape
    if silu_and_mul:
        if k % 2:
            raise ValueError(f"x has {k} columns; silu_and_mul needs gate | up (2 * K)")
        k //= 2
    return m, k


def _check_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale, bias,
                  k: int) -> tuple[int, bool]:
    """The weight [N, K] (x's dtype or FP8 with its per-tensor or per-row scale) and bias
    [N] of a bf16/fp16 x; returns (N, whether FP8)."""
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,) + FP8_DTYPES, device=x.device)
    n = weight.shape[0]
    check_shape("weight", weight, (n, k))
    fp8 = weight.dtype in FP8_DTYPES
    if fp8:
        _check_scale("weight_scale", weight_scale, x.device, "FP8 weights", rows=n)
    elif weight_scale is not None:
        raise ValueError(f"weight_scale is only for FP8 weights; weight is {weight.dtype}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device)
        check_shape("bias", bias, (n,))
    return n, fp8


def _config(config: dict | None, m: int, n: int, k: int, weight_dtype) -> dict:
    """The given config, else the tuned one for this shape, else the default; checked."""
    if config is None:
        config = (_tuned(tuning_key(m, n, k, weight_dtype))
                  or default_config(m, n, k, weight_dtype in FP8_DTYPES))
    return check_config(config)


def _check_scale(name: str, t, device: torch.device, needed_with: str,
                 rows: int | None = None) -> None:
    """A float32 scale on ``device``, required here: per tensor (0-dim or 1 element), or,
    given ``rows``, also one per weight row ([rows], contiguous)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} is required with {needed_with} (a float32 tensor)")
    check_tensor(name, t, dtypes=(torch.float32,), device=device)
    per_row = rows is not None and t.shape == (rows,) and t.is_contiguous()
    if t.numel() != 1 and not per_row:
        also = f" or one per weight row ([{rows}])" if rows is not None else ""
        raise ValueError(f"{name} has shape {tuple(t.shape)}; gemv takes a per-tensor scale "
                         f"(0-dim or 1 element){also}")


def _gemv_w8a8(x, weight, weight_scale, bias, x_scale, config, out_dtype) -> torch.Tensor:
    """gemv's W8A8 form (x e4m3 with x_scale): checks, then the tensor-core kernel."""
    check_tensor("x", x, ndim=2, dtypes=FP8_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FP8_DTYPES, device=x.device)
    if out_dtype not in GEMV_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} must be one of {GEMV_DTYPES}")
    m, k = x.shape
    n = weight.shape[0]
    check_shape("weight", weight, (n, k))
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"x has {m} rows; gemv takes 1 to {GEMV_MAX_M} (use _scaled_mm)")
    _check_scale("weight_scale", weight_scale, x.device, "FP8 x and weights", rows=n)
    _check_scale("x_scale", x_scale, x.device, "FP8 x and weights")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(out_dtype,), device=x.device)
        check_shape("bias", bias, (n,))
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if n == 0 or k == 0:
        return y.zero_()
    cfg = check_config(config or _tuned(tuning_key(m, n, k, W8A8)) or w8a8_config(m, n, k))
    if not cfg["USE_DOT"]:
        raise ValueError(f"config {cfg}: W8A8 (FP8 x) runs on tensor-core tiles only "
                         "(USE_DOT=True)")
    _launch(x, weight, weight_scale, bias, y, x_scale, cfg, False)
    return y


def _launch(x, weight, weight_scale, bias, y, x_scale, cfg: dict, silu_and_mul: bool,
            norm: tuple | None = None, res_epi: tuple | None = None,
            prenorm: tuple | None = None) -> None:
    """The kernel (and the split-K reduce) for checked arguments and a checked config;
    ``norm`` = (residual, norm weight, residual out, eps) for ``gemv_add_rms_norm``;
    ``res_epi`` = (residual, sum-of-squares partials out, next norm weight or None, h * g
    out or None) for ``gemv_add_residual`` (y is the new residual); ``prenorm`` = (partials,
    norm weight, eps) for ``gemv_prenormed``, or (partials, None, eps) for
    ``gemv_rms_scaled`` (the norm in the epilogue)."""
    m, n, k = y.shape[0], y.shape[1], weight.shape[1]
    bn, bk, dot = cfg["BLOCK_N"], cfg["BLOCK_K"], bool(cfg["USE_DOT"])
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(k, bk)))
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk  # K per slice, whole tiles
    split = triton.cdiv(k, k_split)  # no empty slices
    block_m = 16 if dot else m  # CUDA cores: the M rows unrolled
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    fp8 = weight_scale is not None
    scale = weight_scale if fp8 else y  # any pointer when unused
    scale_mode = 0 if not fp8 else 1 if weight_scale.numel() == 1 else 2  # 2: one per row
    b = bias if bias is not None else y
    xs = x_scale if x_scale is not None else y
    _gemv_kernel[(triton.cdiv(n, bn), split, triton.cdiv(m, block_m))](
        x, weight, scale, b, y, part, xs, m, n, k, k_split, x.stride(0), weight.stride(0),
        y.stride(0), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        EVEN_K=k == split * k_split, SPLIT=split > 1, HAS_SCALE=scale_mode,
        HAS_BIAS=bias is not None, WIDEN=env.triton_interpret(), ACT=silu_and_mul,
        X_FP8=x_scale is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        PREFETCH=not dot and _pdl.prefetch(), ESIZE=weight.element_size(),
        HINT=PREFETCH_HINT_BYTES, W_EVICT=WEIGHT_EVICT,
        **_norm_args(norm, k, y) | _residual_args(res_epi, prenorm, y),
        **_pdl.launch_kwargs(),
    )
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _splitk_reduce_kernel[(triton.cdiv(n, block), m)](
            part, scale, b, y, xs, x, m, n, y.stride(0), SPLIT_K=split, HAS_SCALE=scale_mode,
            HAS_BIAS=bias is not None, X_FP8=x_scale is not None, BLOCK=block, num_warps=4,
            **_pdl.launch_kwargs(),
        )


# The L2 eviction priority of weight loads: a decode step streams every weight through L2
# once, and at normal priority that stream evicts what the next kernels read (the KV cache,
# the step's metadata, activations). 8B FP8 batch-1 engine step: 2.753 -> 2.674 ms at
# contexts 129-256, 2.884 -> 2.793 at 1793-1920 (docs/decisions.md). ("" = normal priority.)
WEIGHT_EVICT = "evict_first"


def _residual_args(res_epi: tuple | None, prenorm: tuple | None,
                   y: torch.Tensor) -> dict:
    """The kernel's residual epilogue / pre-normed prologue arguments (``y`` fills unused
    pointers; res_ptr / res_out_ptr / g_ptr / eps come from ``_norm_args`` unless set here)."""
    out = {"ss_ptr": y, "hg_ptr": y, "n_part": 0, "RES_EPI": 0, "PRENORM": 0, "NPART_PAD": 1}
    if res_epi is not None:
        residual, ss, g, hg = res_epi
        out.update(res_ptr=residual, res_out_ptr=y, ss_ptr=ss, RES_EPI=1)
        if hg is not None:
            out.update(g_ptr=g, hg_ptr=hg, RES_EPI=2)
    if prenorm is not None:
        ss, g, eps = prenorm
        out.update(ss_ptr=ss, n_part=ss.shape[0], eps=float(eps), PRENORM=2,
                   NPART_PAD=triton.next_power_of_2(ss.shape[0]))
        if g is not None:
            out.update(g_ptr=g, PRENORM=1)
    return out


def _norm_args(norm: tuple | None, k: int, unused: torch.Tensor) -> dict:
    """The kernel's add + RMSNorm arguments (``unused`` fills the pointers when off)."""
    if norm is None:
        return {"NORM": False, "res_ptr": unused, "g_ptr": unused, "res_out_ptr": unused,
                "eps": 0.0, "K_PAD": 1}
    residual, g, res_out, eps = norm
    return {"NORM": True, "res_ptr": residual, "g_ptr": g, "res_out_ptr": res_out,
            "eps": float(eps), "K_PAD": triton.next_power_of_2(k)}


# The CUDA-core GEMV's L2 hints before its PDL wait (KILN_PDL=2): each program hints the
# first two W tiles of its slice, one hint per PREFETCH_HINT_BYTES. Under PDL, per 128-byte line
# (4x fewer hints than
# per 32-byte sector) the 8B FP8 batch-1 replay went 2.799 -> 2.754 ms, 8B bf16 and smollm2
# unchanged. Hinting the whole slice of small weights (qkv, o_proj) lost (FP8 2.840 ms, or
# 2.861 with line hints), and so did the attention kernel hinting o_proj's weight (2.832).
PREFETCH_HINT_BYTES = 128

# The add + RMSNorm prologue holds one whole row in registers (K_PAD elements per program).
NORM_MAX_K = 16384


def gemv_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, *, config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gemv(rms_norm(x + residual) * norm_weight, weight, ...)`` and the new residual
    ``x + residual``, in one kernel (``fused_add_rms_norm`` then ``gemv``, without the norm
    launch: every program normalises the row itself, one writes the new residual).

    x, residual: [1, K] bf16/fp16 (a decode step of one sequence); norm_weight [K] in x's
    dtype; weight/weight_scale/bias as in ``gemv``; CUDA-core configs only (the default at
    M = 1). Returns (y [1, N], new residual [1, K]). Same rounding points as the two kernels;
    the float32 sum of squares may differ in its last bits (another reduction order).
    """
    check_tensor("x", x, ndim=2, dtypes=GEMV_DTYPES)
    for name, t in (("residual", residual), ("norm_weight", norm_weight)):
        check_tensor(name, t, ndim=2 if name == "residual" else 1, dtypes=(x.dtype,),
                     device=x.device)
    m, k = x.shape
    check_shape("residual", residual, (m, k))
    check_shape("norm_weight", norm_weight, (k,))
    if m != 1:
        raise ValueError(f"x has {m} rows; gemv_add_rms_norm takes one (use "
                         "fused_add_rms_norm, then gemv)")
    if k > NORM_MAX_K:
        raise ValueError(f"K={k} is over the prologue's one-row limit {NORM_MAX_K}")
    if x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("x and residual need a contiguous last dimension")
    n, fp8, config = _one_row_config(x, weight, weight_scale, bias, k, config,
                                     "the add + RMSNorm prologue")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty(1, k, dtype=x.dtype, device=x.device)
    _launch(x, weight, weight_scale if fp8 else None, bias, y, None, config, False,
            norm=(residual, norm_weight, res_out, eps))
    return y, res_out


def _one_row_config(x: torch.Tensor, weight: torch.Tensor, weight_scale, bias, k: int,
                    config: dict | None, what: str) -> tuple[int, bool, dict]:
    """(N, whether FP8, the config) of a one-row fused GEMV, whose config must be CUDA-core."""
    n, fp8 = _check_weight(x, weight, weight_scale, bias, k)
    config = _config(config, 1, n, k, weight.dtype)
    if config["USE_DOT"]:
        raise ValueError(f"config {config}: {what} runs on CUDA-core tiles only "
                         "(USE_DOT=False)")
    return n, fp8, config


def gemv_add_residual(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None, residual: torch.Tensor, *, silu_and_mul: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add in the GEMV's epilogue, one row: ``h = gemv(x) + residual``
    (rounded as ``fused_add_rms_norm`` rounds it), and ``ss`` [programs] float32, the sum of
    h^2 over each program's output tile, which ``gemv_prenormed`` turns into the RMSNorm of
    h without a norm kernel between them.

    x: [1, K] (or [1, 2K] with ``silu_and_mul``); residual [1, N] in x's dtype; weight /
    weight_scale / bias as in ``gemv``. CUDA-core configs without split-K only (the default
    at M = 1 except the smallest N). Returns (h [1, N], ss)."""
    h, ss, _ = _add_residual(x, weight, weight_scale, bias, residual, silu_and_mul, config,
                             None)
    return h, ss


def gemv_add_residual_weighted(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor, *,
    silu_and_mul: bool = False, config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gemv_add_residual`` that also stores ``hg = h * norm_weight`` (the next RMSNorm's
    weight [N], x's dtype; rounded once), the input of ``gemv_rms_scaled``. Returns
    (h [1, N], hg [1, N], ss)."""
    check_tensor("norm_weight", norm_weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_shape("norm_weight", norm_weight, (residual.shape[-1],))
    h, ss, hg = _add_residual(x, weight, weight_scale, bias, residual, silu_and_mul, config,
                              norm_weight)
    return h, hg, ss


def _add_residual(x, weight, weight_scale, bias, residual, silu_and_mul, config,
                  norm_weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    m, k = _check_x(x, silu_and_mul)
    if m != 1:
        raise ValueError(f"x has {m} rows; gemv_add_residual takes one (use gemv, then "
                         "fused_add_rms_norm)")
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dimension")
    n, fp8 = _check_weight(x, weight, weight_scale, bias, k)
    check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("residual", residual, (1, n))
    if residual.stride(-1) != 1:
        raise ValueError("residual needs a contiguous last dimension")
    config = _config(config, 1, n, k, weight.dtype)
    if config["USE_DOT"] or config["SPLIT_K"] > 1:
        raise ValueError(f"config {config}: the residual epilogue runs on CUDA-core tiles "
                         "without split-K only (USE_DOT=False, SPLIT_K=1)")
    h = torch.empty(1, n, dtype=x.dtype, device=x.device)
    hg = torch.empty_like(h) if norm_weight is not None else None
    ss = torch.empty(triton.cdiv(n, config["BLOCK_N"]), dtype=torch.float32, device=x.device)
    _launch(x, weight, weight_scale if fp8 else None, bias, h, None, config, silu_and_mul,
            res_epi=(residual, ss, norm_weight, hg))
    return h, ss, hg


def gemv_rms_scaled(
    hg: torch.Tensor, ss: torch.Tensor, eps: float, weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``gemv(rms_norm(h) * g, weight, ...)`` computed as ``gemv(hg) / rms(h)`` for one row:
    hg = h * g and the partial sums of h^2 from ``gemv_add_residual_weighted``; the loop is
    the plain GEMV's and each program scales its outputs by 1 / rms(h) in the epilogue (it
    sums the partials there, in a fixed order: deterministic). One rounding of the input
    (h * g) instead of rms_norm's two (h / rms, then * g), so not bit-equal to rms_norm then
    gemv; the same within bf16 rounding. CUDA-core configs only."""
    return _statistics_gemv("hg", hg, ss, None, eps, weight, weight_scale, bias, config,
                            "gemv_rms_scaled", "the epilogue-normed GEMV")


def gemv_prenormed(
    h: torch.Tensor, ss: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, config: dict | None = None,
) -> torch.Tensor:
    """``gemv(rms_norm(h) * norm_weight, weight, ...)`` for one row h [1, K] whose sum of
    squares comes in partials ``ss`` (``gemv_add_residual``): each program sums the partials
    (a fixed order: deterministic) and normalises each x tile as it loads it. Same rounding
    points as rms_norm then gemv; the float32 sum of squares may differ in its last bits
    (another reduction order). CUDA-core configs only."""
    return _statistics_gemv("h", h, ss, norm_weight, eps, weight, weight_scale, bias, config,
                            "gemv_prenormed", "the pre-normed prologue")


def _statistics_gemv(name: str, x: torch.Tensor, ss: torch.Tensor, norm_weight, eps: float,
                     weight, weight_scale, bias, config, fn: str, what: str) -> torch.Tensor:
    """gemv_prenormed (``norm_weight`` given) / gemv_rms_scaled (None): checks, launch."""
    check_tensor(name, x, ndim=2, dtypes=GEMV_DTYPES)
    check_tensor("ss", ss, ndim=1, dtypes=(torch.float32,), device=x.device)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    m, k = x.shape
    if m != 1:
        raise ValueError(f"{name} has {m} rows; {fn} takes one")
    if norm_weight is not None:
        check_shape("norm_weight", norm_weight, (k,))
    if x.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")
    if not 1 <= ss.shape[0] <= PRENORM_MAX_PARTS:
        raise ValueError(f"ss has {ss.shape[0]} partials; 1 to {PRENORM_MAX_PARTS} allowed")
    n, fp8, config = _one_row_config(x, weight, weight_scale, bias, k, config, what)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _launch(x, weight, weight_scale if fp8 else None, bias, y, None, config, False,
            prenorm=(ss, norm_weight, eps))
    return y


def residual_fusion_form(m: int, hidden: int, k_in: int, n_out: int,
                         in_dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    """How ``linear -> + residual -> RMSNorm -> linear`` runs at this shape, or None (GEMV,
    norm kernel, GEMV):

    - ``"prologue"``: gemv_add_residual then gemv_prenormed (normalised as x is loaded),
      hidden at most RESIDUAL_FUSION_MAX_HIDDEN;
    - ``"epilogue"``: gemv_add_residual_weighted then gemv_rms_scaled (the plain loop on
      h * g, 1 / rms in the epilogue), larger hidden.

    Both need one row, both GEMVs taken by ``gemv`` on CUDA-core tiles, the first without
    split-K (its partials are the statistics). ``in_dtype`` / ``out_dtype``: the two
    weights' dtypes; the first weight is [hidden, k_in], the second [n_out, hidden]."""
    if m != 1:
        return None
    form = "prologue" if hidden <= RESIDUAL_FUSION_MAX_HIDDEN else "epilogue"
    fp8_a, fp8_b = in_dtype in FP8_DTYPES, out_dtype in FP8_DTYPES
    if not (gemv_wins(1, hidden, k_in, fp8_a) and gemv_wins(1, n_out, hidden, fp8_b)):
        return None
    a = _config(None, 1, hidden, k_in, in_dtype)
    b = _config(None, 1, n_out, hidden, out_dtype)
    ok = (not a["USE_DOT"] and a["SPLIT_K"] == 1 and not b["USE_DOT"]
          and triton.cdiv(hidden, a["BLOCK_N"]) <= PRENORM_MAX_PARTS)
    return form if ok else None


def residual_fusion_applies(m: int, hidden: int, k_in: int, n_out: int,
                            in_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether ``residual_fusion_form`` is the prologue form (gemv_prenormed)."""
    return residual_fusion_form(m, hidden, k_in, n_out, in_dtype, out_dtype) == "prologue"


# The model runs each ``linear -> + residual -> RMSNorm -> linear`` of a batch-1 step
# as two GEMVs (the residual add and the sum of squares in the first one's epilogue, the
# normalisation in the second one's loads) instead of GEMV, norm kernel, GEMV (or the norm
# prologue, which recomputes the row's statistics in every program), and up to which hidden
# size it pays: smollm2 (hidden 576) decode replay 0.503 -> 0.493 ms (against the norm
# prologue); llama-3-8b (hidden 4096) engine step FP8 2.650 -> 3.028 ms, because the first
# GEMV holds its residual tile across its loop (8B's 8-warp FP8 producer, 64 -> 78 registers, 4 ->
# 3 programs per SM).
RESIDUAL_FUSION_MAX_HIDDEN = 2048
PRENORM_MAX_PARTS = 4096
# Above RESIDUAL_FUSION_MAX_HIDDEN: the epilogue form. The first GEMV loads its residual
# tile after its loop and also stores h * g (g: the norm's weight); the second runs the plain
# GEMV loop on h * g (its registers unchanged) and scales its outputs by 1 / rms(h) after
# the loop. llama-3-8b engine step: FP8 2.603 -> 2.590 ms, bf16 4.057 -> 4.002
# (docs/decisions.md).


def norm_prologue_applies(m: int, n: int, k: int, weight_dtype: torch.dtype) -> bool:
    """Whether linear's add + RMSNorm goes into the GEMV (``gemv_add_rms_norm``): one row,
    where the GEMV takes the shape and its config is CUDA-core (the M = 1 default)."""
    fp8 = weight_dtype in FP8_DTYPES
    if not (m == 1 and k <= min(NORM_PROLOGUE_MAX_K, NORM_MAX_K)
            and gemv_wins(m, n, k, fp8)):
        return False
    return not _config(None, m, n, k, weight_dtype)["USE_DOT"]


# Whether the model folds each add + RMSNorm into the following GEMV at batch 1, and up to
# which K it pays. Every program recomputes the row's statistics (N / BLOCK_N times), against
# one kernel launch saved. Under PDL: smollm2 (K 576) decode replay 0.547 -> 0.500 ms; llama-3-8b
# (K 4096)
# bf16 4.191 -> 4.261 (a loss), FP8 2.814 -> 2.780 alone and nothing on top of the SiLU
# fusion (2.751 -> 2.750). K between 576 and 4096 is not measured; 2048 splits the two.
NORM_PROLOGUE_MAX_K = 2048


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, silu_and_mul: bool = False,
) -> torch.Tensor:
    """float32 reference of ``gemv``: (x @ (W * scale)^T + bias) rounded once to x's dtype
    (with ``silu_and_mul``, x is first replaced by the eager silu(gate) * up in x's dtype)."""
    if silu_and_mul:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    w = weight.float()
    if weight_scale is not None:  # per tensor or per row
        w = w * weight_scale.float().reshape(-1, 1)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
