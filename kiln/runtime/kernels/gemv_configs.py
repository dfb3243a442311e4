"""Which path and launch config each GEMV shape takes: the configs, and the measured rules.

A config is a dict (``CONFIG_KEYS``): tile sizes, split-K, CUDA cores or tensor cores
(``USE_DOT``), warps and stages. ``resolve_config`` picks the given config, else the one
tuned at build for this shape (``tuned_configs.lookup("gemv", tuning_key(...))``), else
``default_config``, the rule measured against cuBLAS. The routing rules (``gemv_wins``,
``w8a8_wins``, ``silu_fusion_applies``, ``norm_prologue_applies``, ``residual_fusion_form``)
are what kiln/runtime/layers/linear.py asks to choose between the skinny GEMM, its fused
forms and cuBLAS; each rule's comment holds the measurement behind it (docs/decisions.md).

Plain Python over torch dtypes: importing this module does not import triton.
"""

from __future__ import annotations

import functools

import torch

from kiln.runtime.kernels import tuned_configs
from kiln.runtime.kernels._checks import FP8_DTYPES, cdiv

GEMV_MAX_M = 8  # rows of the CUDA-core tiles (unrolled) and of the W8A8 form
# Tensor-core tiles take up to GEMM_MAX_M rows, BLOCK_M = 16 per program (grid axis 2): the
# speculative steps' 9-128-token batches, where cuBLAS is launch-bound and, not being a PDL
# kernel, a full barrier in the chain. Each 16-row block reads the whole weight again, so
# ``gemv_wins`` routes them here up to one block (GEMM_ONE_BLOCK_M rows) on any bf16 weight,
# and past it only on small weights (GEMM_SMALL_WEIGHT elements), where reads are cheap and
# launches are what costs. H200, graph replay ms, cuBLAS -> these tiles (docs/decisions.md):
# smollm2 (every weight <= 1.8 M elements) 9 rows 0.995 -> 0.743, 18 1.018 -> 0.781, 72
# 1.097 -> 0.940, 84 1.152 -> 1.091; Qwen2.5-1.5B shape 9 rows 1.61-1.74 -> 1.53, but 18
# rows 1.65-1.77 -> 2.05 and 84 rows 2.14 -> 4.94 (its weights are 2.4-27.5 M elements).
GEMM_MAX_M = 128
GEMM_ONE_BLOCK_M = 16
GEMM_SMALL_WEIGHT = 2 << 20
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
    blocks = cdiv(n, cfg["BLOCK_N"])
    split = 1
    if blocks < 64 and k >= 1024:  # too few programs to fill 132 SMs
        split = min(8, cdiv(132, blocks), k // cfg["BLOCK_K"])
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
    split = 4 if cdiv(n, 64) < 256 and k >= 4 * 128 else 1
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
    where cuBLAS is ~5 % faster); past GEMV_MAX_M rows (speculative steps, tensor-core
    tiles) up to GEMM_ONE_BLOCK_M rows, or up to GEMM_MAX_M on small weights. FP8: always
    at M = 1 (W8A16 streams half the bytes of bf16 with no activation quant); at M >= 2
    only up to 4096 x 4096 weights: beyond that W8A8 on the FP8 tensor cores wins
    (widening e4m3 in registers costs ALU time at M > 1).
    """
    if m > GEMV_MAX_M:  # tensor-core tiles (bf16/fp16): see GEMM_ONE_BLOCK_M
        if fp8 or m > GEMM_MAX_M or (k < 1024 and n >= 16384):
            return False
        return m <= GEMM_ONE_BLOCK_M or n * k <= GEMM_SMALL_WEIGHT
    if m < 1:
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
    blocks = cdiv(n, cfg["BLOCK_N"])
    for s in (2, 4, 8):
        if blocks * s <= 8 * 132 and k >= s * cfg["BLOCK_K"]:
            out.append(s)
    return out


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


def resolve_config(config: dict | None, m: int, n: int, k: int, weight_dtype) -> dict:
    """The given config, else the tuned one for this shape, else the default; checked."""
    if config is None:
        config = (_tuned(tuning_key(m, n, k, weight_dtype))
                  or default_config(m, n, k, weight_dtype in FP8_DTYPES))
    return check_config(config)


def resolve_w8a8_config(config: dict | None, m: int, n: int, k: int) -> dict:
    """The W8A8 form's config: the given one, else the tuned one, else ``w8a8_config``;
    checked."""
    return check_config(config or _tuned(tuning_key(m, n, k, W8A8)) or w8a8_config(m, n, k))


def _tuned(key: str) -> dict | None:
    return tuned_configs.lookup("gemv", key)


# The add + RMSNorm prologue holds one whole row in registers (K_PAD elements per program).
NORM_MAX_K = 16384


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
    a = resolve_config(None, 1, hidden, k_in, in_dtype)
    b = resolve_config(None, 1, n_out, hidden, out_dtype)
    ok = (not a["USE_DOT"] and a["SPLIT_K"] == 1 and not b["USE_DOT"]
          and cdiv(hidden, a["BLOCK_N"]) <= PRENORM_MAX_PARTS)
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
    return not resolve_config(None, m, n, k, weight_dtype)["USE_DOT"]


# Whether the model folds each add + RMSNorm into the following GEMV at batch 1, and up to
# which K it pays. Every program recomputes the row's statistics (N / BLOCK_N times), against
# one kernel launch saved. Under PDL: smollm2 (K 576) decode replay 0.547 -> 0.500 ms; llama-3-8b
# (K 4096)
# bf16 4.191 -> 4.261 (a loss), FP8 2.814 -> 2.780 alone and nothing on top of the SiLU
# fusion (2.751 -> 2.750). K between 576 and 4096 is not measured; 2048 splits the two.
NORM_PROLOGUE_MAX_K = 2048
