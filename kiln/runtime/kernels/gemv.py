"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for 1 <= M <= GEMV_MAX_M.

W is row-major [N, K] like ``F.linear``'s weight: bf16/fp16 (the input dtype), or FP8 e4m3
with a per-tensor float32 ``weight_scale`` (W8A16: activations stay bf16/fp16, weights are
widened in registers, float32 accumulation, the scale applied once per output). At batch 1
the whole cost is streaming W once, so the kernel is about bytes in flight:

- ``USE_DOT=False`` (CUDA cores): a program owns BLOCK_N rows of W; each loop step loads a
  [BLOCK_N, BLOCK_K] tile and the matching x columns and accumulates x * w elementwise into
  a float32 [BLOCK_N, BLOCK_M, BLOCK_K] register tile ([BLOCK_N, BLOCK_K] at M = 1),
  reduced over K once at the end (no shuffles in the loop). BLOCK_M = next_pow2(M).
- ``USE_DOT=True`` (tensor cores, "swap AB"): acc[BLOCK_N, 16] += W_tile @ x_tile^T with
  the M rows padded to 16 by masking (masked lanes read no memory); Triton pipelines the
  W tiles through shared memory ``num_stages`` deep.
- ``SPLIT_K > 1``: program (n, s) covers K slice s and writes a float32 partial
  [SPLIT_K, M, N]; ``_splitk_reduce_kernel`` sums the slices in a fixed order (deterministic),
  applies scale and bias and casts. Worth its second launch only where N is small.

Everything stays on the device (graph-safe): no host syncs, the scale is read by the kernel,
the split-K workspace size depends on the shapes only. Configs are dicts (``GEMV_CONFIGS``);
``gemv(config=None)`` asks ``kiln.runtime.kernels.tuning.lookup("gemv", key)`` first (a
build-time tuned table, when that module exists) and falls back to ``default_config``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kiln.runtime.kernels._checks import FP8_DTYPES, check_shape, check_tensor, next_pow2

GEMV_MAX_M = 8  # rows handled here; linear() sends larger batches to cuBLAS / _scaled_mm
GEMV_DTYPES = (torch.bfloat16, torch.float16)
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
    _cfg(8, 512, False, stages=3),
    _cfg(16, 256, True, stages=4),
    _cfg(16, 512, True, stages=3),
    _cfg(32, 256, True, stages=4),
    _cfg(64, 128, True, stages=4),
    _cfg(64, 256, True, warps=8, stages=3),
    _cfg(128, 128, True, warps=8, stages=3),
]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N re-read row offs_n % N (valid memory, no mask in the loop) and are not stored
    rows_n = (offs_n % N).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if USE_DOT:
        # x^T tile [BLOCK_K, BLOCK_M]; acc [BLOCK_N, BLOCK_M] = W_tile @ x_tile^T ("swap AB")
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kk in range(0, K_SPLIT, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = offs_k + kk < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if WIDEN:  # the CPU interpreter's bf16 dot is wrong; same numbers in float32
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(w.to(xt.dtype), xt, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    else:
        # x tile [BLOCK_M, BLOCK_K]; elementwise products into [BLOCK_N, BLOCK_M, BLOCK_K]
        if BLOCK_M == 1:  # one row: a 2D [BLOCK_N, BLOCK_K] accumulator
            x_ptrs = x_ptr + offs_k
            acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for kk in range(0, K_SPLIT, BLOCK_K):
                if EVEN_K:
                    w = tl.load(w_ptrs)
                    xv = tl.load(x_ptrs)
                else:
                    k_ok = offs_k + kk < K
                    w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                    xv = tl.load(x_ptrs, mask=k_ok, other=0.0)
                acc2 += w.to(tl.float32) * xv.to(tl.float32)[None, :]
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
            acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]
        else:
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            acc3 = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
            for kk in range(0, K_SPLIT, BLOCK_K):
                if EVEN_K:
                    w = tl.load(w_ptrs)
                    xv = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                else:
                    k_ok = offs_k + kk < K
                    w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                    xv = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                acc3 += w.to(tl.float32)[:, None, :] * xv.to(tl.float32)[None, :, :]
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
            acc = tl.sum(acc3, axis=2)  # [BLOCK_N, BLOCK_M]
    out_ok = (offs_n[:, None] < N) & m_ok[None, :]
    if SPLIT:
        p_ptrs = part_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=out_ok)
    else:
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows_n).to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr, scale_ptr, bias_ptr, y_ptr, M, N, stride_ym,
    SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def tuning_key(m: int, n: int, k: int, dtype: torch.dtype | str) -> str:
    """The key of one shape in the tuning table: ``"{m}x{n}x{k}:{fp8|bfloat16|float16}"``
    (``dtype`` is the weight dtype; any FP8 weight is ``fp8``)."""
    if isinstance(dtype, torch.dtype):
        dtype = "fp8" if dtype in FP8_DTYPES else str(dtype).removeprefix("torch.")
    return f"{m}x{n}x{k}:{dtype}"


@functools.lru_cache(maxsize=1024)
def default_config(m: int, n: int, k: int, fp8: bool) -> dict:
    """The measured best rule on the H200 (notes/NOTES.md, 2026-11-30)."""
    del fp8
    if m <= 4:
        cfg = _cfg(8, 512, False) if k >= 1024 else _cfg(8, 1024, False, warps=8)
    else:
        cfg = _cfg(32, 256, True, stages=4)
    blocks = triton.cdiv(n, cfg["BLOCK_N"])
    if blocks < 132 and k >= 4 * cfg["BLOCK_K"]:  # too few programs to fill the SMs
        cfg = dict(cfg, SPLIT_K=min(8, triton.cdiv(264, blocks), k // (2 * cfg["BLOCK_K"])))
    return cfg


def gemv_wins(m: int, n: int, k: int, fp8: bool) -> bool:
    """Whether ``gemv`` beat cuBLAS (F.linear, or _scaled_mm for FP8) at this shape on the
    H200 (scripts/bench_gemv.py; linear() routes small batches by this rule)."""
    del n, k, fp8
    return 1 <= m <= GEMV_MAX_M


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
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (weight [N, K] * weight_scale)^T + bias, in x's dtype.

    x: bf16/fp16, 1 <= M <= GEMV_MAX_M rows (row stride free, last dim contiguous).
    weight: x's dtype, or float8_e4m3fn with ``weight_scale`` a 0-dim or 1-element float32
    tensor on x's device (required for FP8, refused otherwise). bias: [N] in x's dtype.
    """
    check_tensor("x", x, ndim=2, dtypes=GEMV_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,) + FP8_DTYPES, device=x.device)
    m, k = x.shape
    n = weight.shape[0]
    check_shape("weight", weight, (n, k))
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"x has {m} rows; gemv takes 1 to {GEMV_MAX_M} (use F.linear)")
    fp8 = weight.dtype in FP8_DTYPES
    if fp8:
        if not isinstance(weight_scale, torch.Tensor):
            raise ValueError("weight_scale is required with FP8 weights (a float32 tensor)")
        check_tensor("weight_scale", weight_scale, dtypes=(torch.float32,), device=x.device)
        if weight_scale.numel() != 1:
            raise ValueError(f"weight_scale has shape {tuple(weight_scale.shape)}; gemv "
                             "takes a per-tensor scale (0-dim or 1 element)")
    elif weight_scale is not None:
        raise ValueError(f"weight_scale is only for FP8 weights; weight is {weight.dtype}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device)
        check_shape("bias", bias, (n,))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return y.zero_()
    if config is None:
        config = _tuned(tuning_key(m, n, k, weight.dtype)) or default_config(m, n, k, fp8)
    cfg = check_config(config)
    bn, bk, dot = cfg["BLOCK_N"], cfg["BLOCK_K"], bool(cfg["USE_DOT"])
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(k, bk)))
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk  # K per slice, whole tiles
    split = triton.cdiv(k, k_split)  # no empty slices
    block_m = 16 if dot else next_pow2(m)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    scale = weight_scale if fp8 else y  # any pointer when unused
    b = bias if bias is not None else y
    _gemv_kernel[(triton.cdiv(n, bn), split)](
        x, weight, scale, b, y, part, m, n, k, k_split, x.stride(0), weight.stride(0),
        y.stride(0), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        EVEN_K=k == split * k_split, SPLIT=split > 1, HAS_SCALE=fp8,
        HAS_BIAS=bias is not None, WIDEN=_interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _splitk_reduce_kernel[(triton.cdiv(n, block), m)](
            part, scale, b, y, m, n, y.stride(0), SPLIT_K=split, HAS_SCALE=fp8,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
    return y


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 reference of ``gemv``: (x @ (W * scale)^T + bias) rounded once to x's dtype."""
    w = weight.float()
    if weight_scale is not None:
        w = w * weight_scale.float().reshape(())
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
