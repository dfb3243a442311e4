"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for 1 <= M <= GEMM_MAX_M.

The checked wrappers of the kernel in kiln/runtime/kernels/gemv_kernel.py (each validates
shapes, dtypes and devices and raises ``ValueError`` naming the bad argument), and the torch
reference ``gemv_ref``:

- ``gemv``: bf16/fp16 x times bf16/fp16 or FP8 (W8A16) weights, or e4m3 x times FP8
  weights (W8A8, tensor-core tiles);
- ``gemv_add_rms_norm`` (one row, CUDA-core tiles): x is the addend of a residual stream;
  every program computes rms_norm(x + residual) itself and normalises each x tile as it
  loads it, and program (0, 0) writes the new residual: the add + RMSNorm kernel before the
  projection is gone;
- ``gemv_add_residual`` / ``gemv_add_residual_weighted`` then ``gemv_prenormed`` /
  ``gemv_rms_scaled`` (one row): a projection, the residual add and the RMSNorm before the
  next projection in two GEMVs (the add and the statistics in the first one's epilogue).

Which of these a shape takes, and with which config, is kiln/runtime/kernels/gemv_configs.py:
``config=None`` is the tuned config for the shape where one is installed, else
``gemv_configs.default_config``.
"""

from __future__ import annotations

import torch

from kiln.runtime.kernels._checks import FP8_DTYPES, cdiv, check_shape, check_tensor
from kiln.runtime.kernels.gemv_configs import (
    GEMM_MAX_M,
    GEMV_DTYPES,
    GEMV_MAX_M,
    NORM_MAX_K,
    PRENORM_MAX_PARTS,
    resolve_config,
    resolve_w8a8_config,
)
from kiln.runtime.kernels.gemv_kernel import launch


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
    ``x_scale``, per tensor (0-dim or 1 element) or per row ([M_x, 1] float32, M_x >= M,
    contiguous: the per-token scales, pad rows unread), and FP8 weights: the FP8 tensor
    cores' product, scaled by weight_scale * x_scale, returned in ``out_dtype`` (bf16/fp16,
    default bf16):
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
    config = resolve_config(config, m, n, k, weight.dtype)
    if m > GEMV_MAX_M and not config["USE_DOT"]:
        raise ValueError(f"x has {m} rows; CUDA-core configs (USE_DOT=False) take at most "
                         f"{GEMV_MAX_M}: use a tensor-core config (got {config})")
    launch(x, weight, weight_scale if fp8 else None, bias, y, None, config, silu_and_mul)
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


def _check_x_scale(x_scale, m: int, device: torch.device) -> None:
    """W8A8's x_scale: float32 on ``device``, per tensor, or one per row of x ([M_x, 1],
    M_x >= m, contiguous)."""
    if not isinstance(x_scale, torch.Tensor):
        raise ValueError("x_scale is required with FP8 x and weights (a float32 tensor)")
    check_tensor("x_scale", x_scale, dtypes=(torch.float32,), device=device)
    per_row = (x_scale.dim() == 2 and x_scale.shape[1] == 1 and x_scale.shape[0] >= m
               and x_scale.is_contiguous())
    if x_scale.numel() != 1 and not per_row:
        raise ValueError(f"x_scale has shape {tuple(x_scale.shape)}; gemv takes a per-tensor "
                         f"scale (0-dim or 1 element) or one per row of x ([>= {m}, 1])")


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
    _check_x_scale(x_scale, m, x.device)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(out_dtype,), device=x.device)
        check_shape("bias", bias, (n,))
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if n == 0 or k == 0:
        return y.zero_()
    cfg = resolve_w8a8_config(config, m, n, k)
    if not cfg["USE_DOT"]:
        raise ValueError(f"config {cfg}: W8A8 (FP8 x) runs on tensor-core tiles only "
                         "(USE_DOT=True)")
    launch(x, weight, weight_scale, bias, y, x_scale, cfg, False)
    return y


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
    launch(x, weight, weight_scale if fp8 else None, bias, y, None, config, False,
            norm=(residual, norm_weight, res_out, eps))
    return y, res_out


def _one_row_config(x: torch.Tensor, weight: torch.Tensor, weight_scale, bias, k: int,
                    config: dict | None, what: str) -> tuple[int, bool, dict]:
    """(N, whether FP8, the config) of a one-row fused GEMV, whose config must be CUDA-core."""
    n, fp8 = _check_weight(x, weight, weight_scale, bias, k)
    config = resolve_config(config, 1, n, k, weight.dtype)
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
    config = resolve_config(config, 1, n, k, weight.dtype)
    if config["USE_DOT"] or config["SPLIT_K"] > 1:
        raise ValueError(f"config {config}: the residual epilogue runs on CUDA-core tiles "
                         "without split-K only (USE_DOT=False, SPLIT_K=1)")
    h = torch.empty(1, n, dtype=x.dtype, device=x.device)
    hg = torch.empty_like(h) if norm_weight is not None else None
    ss = torch.empty(cdiv(n, config["BLOCK_N"]), dtype=torch.float32, device=x.device)
    launch(x, weight, weight_scale if fp8 else None, bias, h, None, config, silu_and_mul,
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
    launch(x, weight, weight_scale if fp8 else None, bias, y, None, config, False,
            prenorm=(ss, norm_weight, eps))
    return y


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
