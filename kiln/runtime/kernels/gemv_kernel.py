"""The skinny GEMM's Triton kernel, y[M, N] = x[M, K] @ W[N, K]^T (+ bias), and its launch.

W is row-major [N, K] like ``F.linear``'s weight: bf16/fp16 (the input dtype), or FP8 e4m3
with a float32 ``weight_scale``, per tensor or one per row (the FP8 lm_head) (W8A16:
activations stay bf16/fp16, weights are widened in registers, float32 accumulation, the
scale applied once per output). At batch 1 the whole cost is streaming W once, so the kernel
is about bytes in flight:

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

The fused forms (``NORM``: the add + RMSNorm prologue; ``RES_EPI``: the residual add and the
sum of squares in the epilogue; ``PRENORM``: the RMSNorm of the previous GEMV's output in the
loads or the epilogue) are the wrappers' in kiln/runtime/kernels/gemv.py, which check the
arguments and call ``launch``. Everything stays on the device (graph-safe): no host syncs,
the scale is read by the kernel, the split-K workspace size depends on the shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime import env
from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._pdl import pdl_begin
from kiln.runtime.kernels.gemv_tiles import (
    _fma_row,
    _load_x,
    _norm_tile,
    _prefetch_slice,
    _prenorm_tile,
    _scaled,
    _store_residual,
    _store_row,
)

# The CUDA-core GEMV's L2 hints before its PDL wait (KILN_PDL=2): each program hints the
# first two W tiles of its slice, one hint per PREFETCH_HINT_BYTES. Under PDL, per 128-byte line
# (4x fewer hints than
# per 32-byte sector) the 8B FP8 batch-1 replay went 2.799 -> 2.754 ms, 8B bf16 and smollm2
# unchanged. Hinting the whole slice of small weights (qkv, o_proj) lost (FP8 2.840 ms, or
# 2.861 with line hints), and so did the attention kernel hinting o_proj's weight (2.832).
PREFETCH_HINT_BYTES = 128

# The L2 eviction priority of weight loads: a decode step streams every weight through L2
# once, and at normal priority that stream evicts what the next kernels read (the KV cache,
# the step's metadata, activations). 8B FP8 batch-1 engine step: 2.753 -> 2.674 ms at
# contexts 129-256, 2.884 -> 2.793 at 1793-1920 (docs/decisions.md). ("" = normal priority.)
WEIGHT_EVICT = "evict_first"


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
            if X_FP8 == 1:  # x's scale per tensor
                acc = acc * tl.load(xs_ptr)
            elif X_FP8 == 2:  # per row of x (token): column m of the swapped product
                acc = acc * tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)[None, :]
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
    if X_FP8 == 1:
        acc = acc * tl.load(xs_ptr)
    elif X_FP8 == 2:
        acc = acc * tl.load(xs_ptr + m)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if not X_FP8:  # float32 y: the x-dtype result, widened (x_ptr: only its dtype is used)
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def launch(x, weight, weight_scale, bias, y, x_scale, cfg: dict, silu_and_mul: bool,
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
    # X_FP8: 0 bf16/fp16 x, 1 e4m3 x with one scale, 2 with one scale per row
    x_fp8 = 0 if x_scale is None else 1 if x_scale.numel() == 1 else 2
    _gemv_kernel[(triton.cdiv(n, bn), split, triton.cdiv(m, block_m))](
        x, weight, scale, b, y, part, xs, m, n, k, k_split, x.stride(0), weight.stride(0),
        y.stride(0), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        EVEN_K=k == split * k_split, SPLIT=split > 1, HAS_SCALE=scale_mode,
        HAS_BIAS=bias is not None, WIDEN=env.triton_interpret(), ACT=silu_and_mul,
        X_FP8=x_fp8, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        PREFETCH=not dot and _pdl.prefetch(), ESIZE=weight.element_size(),
        HINT=PREFETCH_HINT_BYTES, W_EVICT=WEIGHT_EVICT,
        **_norm_args(norm, k, y) | _residual_args(res_epi, prenorm, y),
        **_pdl.launch_kwargs(),
    )
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _splitk_reduce_kernel[(triton.cdiv(n, block), m)](
            part, scale, b, y, xs, x, m, n, y.stride(0), SPLIT_K=split, HAS_SCALE=scale_mode,
            HAS_BIAS=bias is not None, X_FP8=x_fp8, BLOCK=block, num_warps=4,
            **_pdl.launch_kwargs(),
        )


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
