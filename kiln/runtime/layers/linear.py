"""Linear layers over prepared engine weights: plain (bf16/fp16/fp32) and FP8 E4M3.

An FP8 linear ``prefix`` has, in the weights dict (see kiln/builder/weights.py):

    {prefix}.weight        [N, K] float8_e4m3fn    W ~= weight.float() * weight_scale
    {prefix}.weight_scale  [] float32              per-tensor dequantization scale, or [N]:
                                                   one per row (the FP8 lm_head)
    {prefix}.input_scale   [] float32              static activation scale (optional; absent
                                                   means dynamic per-tensor activation scale)
    {prefix}.bias          [N]                     optional, engine dtype

CUDA runs ``torch._scaled_mm`` (FP8 tensor cores) after one fused Triton kernel quantizes
the activations into an M-padded buffer (kiln/runtime/kernels/fp8_quant.py; dynamic scales
add an amax kernel), or, at M <= 8 on large weights (``gemv.w8a8_wins``), the Triton FP8
tensor-core skinny GEMM on the same quantized activations; everything else, and shapes
_scaled_mm refuses, runs the dequantized matmul. Both paths quantize activations the same
way (x -> e4m3(x / s), bit-exact), so the CPU result is the GPU result up to accumulation
order. A per-row weight scale (the FP8 lm_head) is applied in the GEMV's epilogue, or after a
float32 _scaled_mm.

Small batches on CUDA (decode: at most ``GEMV_MAX_M`` rows, bf16/fp16 activations) go to
the Triton skinny GEMM in kiln/runtime/kernels/gemv.py where it was measured faster than cuBLAS
(``gemv_wins``). For FP8 weights that path is W8A16: activations stay bf16/fp16, the
e4m3 weights are widened in registers and accumulated in float32, and ``input_scale`` is not
used, which is at least as accurate as W8A8 (only the weights carry FP8 error). float32
weights, CPU and every other case keep the paths above unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln.runtime.fp8 import FP8, FP8_MAX, fp8_scale, quantize_fp8  # noqa: F401 - re-exported


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def scaled_mm_ok(m: int, k: int, n: int) -> bool:
    """torch._scaled_mm shape rules: K and N multiples of 16 (M is padded by us)."""
    return k % 16 == 0 and n % 16 == 0 and m > 0


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T (+ bias) with FP8 weights; x [..., K] in the compute dtype, returns x.dtype.

    Activations are quantized per tensor with ``input_scale`` (static, from calibration) or
    with their own amax (dynamic).
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [M, K]
    n, k = weight.shape
    m = x2.shape[0]
    if x.is_cuda and scaled_mm_ok(m, k, n):
        xq, x_scale = _quantize_padded(x2, input_scale)  # [M rounded up to 16, K] e4m3
        gemv = _w8a8_gemv(m, n, k, x, weight_scale)
        if gemv is not None:  # small M: the Triton FP8 tensor-core GEMM beats cuBLAS here
            y = gemv.gemv(xq[:m], weight, weight_scale.reshape(-1), x_scale=x_scale,
                          out_dtype=x.dtype)
        elif weight_scale.numel() > 1:  # x's scale per tensor, then each row's scale
            y = (torch._scaled_mm(xq, weight.t(), scale_a=x_scale.reshape(()),
                                  scale_b=torch.ones((), device=x.device),
                                  out_dtype=torch.float32)[:m]
                 * weight_scale.float().reshape(1, -1)).to(x.dtype)
        else:
            # weight is [N, K] row-major: weight.t() is the column-major [K, N] it wants
            y = torch._scaled_mm(
                xq, weight.t(), scale_a=x_scale.reshape(()),
                scale_b=weight_scale.float().reshape(()), out_dtype=x.dtype,
            )[:m]
    else:
        x_scale = fp8_scale(x2) if input_scale is None else input_scale.float()
        xq = quantize_fp8(x2, x_scale)  # [M, K] e4m3
        # The reference: the same quantized activations, dequantized, in the compute dtype
        # (float32 accumulation on CPU).
        acc = torch.float32 if x.device.type == "cpu" else x.dtype
        xd = xq.to(acc) * x_scale.to(acc)
        wd = weight.to(acc) * weight_scale.to(acc).reshape(-1, 1)  # per tensor or per row
        y = F.linear(xd, wd).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], n)


def _w8a8_gemv(m: int, n: int, k: int, x: torch.Tensor, weight_scale: torch.Tensor):
    """The gemv module where its W8A8 form takes this GEMM (``gemv.w8a8_wins``), else None."""
    if (x.dtype not in (torch.bfloat16, torch.float16) or weight_scale.dtype != torch.float32
            or not _triton()):
        return None
    from kiln.runtime.kernels import gemv

    return gemv if gemv.w8a8_wins(m, n, k) else None


def _quantize_padded(
    x2: torch.Tensor, input_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3(x / s) into [M rounded up to 16, K] with zero pad rows (older torch/cuBLAS want
    M % 16 too), and s: one Triton kernel (two with a dynamic scale), eager without triton."""
    xs = None if input_scale is None else input_scale.float()
    if _triton():
        from kiln.runtime.kernels.fp8_quant import quantize_fp8_padded

        return quantize_fp8_padded(x2 if x2.stride(-1) == 1 else x2.contiguous(), xs)
    x_scale = fp8_scale(x2) if xs is None else xs
    xq = quantize_fp8(x2, x_scale)
    pad = -x2.shape[0] % 16
    if pad:
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
    return xq, x_scale


@functools.cache
def _triton() -> bool:
    from kiln.runtime.kernels import available

    return available()


def _kernel_operands(x: torch.Tensor, weight: torch.Tensor, w: dict[str, torch.Tensor],
                     prefix: str, bias: torch.Tensor | None,
                     k: int) -> tuple[bool, torch.Tensor | None]:
    """(whether gemv's kernels take this weight, its FP8 scale): [N, K] row-major in x's
    dtype, or FP8 with a per-tensor float32 scale; a bias in x's dtype."""
    fp8 = weight.dtype == FP8
    scale = w.get(prefix + ".weight_scale") if fp8 else None
    ok = ((fp8 or weight.dtype == x.dtype) and weight.shape[1] == k
          and weight.stride(-1) == 1 and (bias is None or bias.dtype == x.dtype)
          and (not fp8 or (scale is not None and scale.dtype == torch.float32
                           and scale.numel() in (1, weight.shape[0]))))
    return ok, scale


def _small_m_gemv(x: torch.Tensor, weight: torch.Tensor, w: dict[str, torch.Tensor],
                  prefix: str, bias: torch.Tensor | None,
                  silu_and_mul: bool = False,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """The Triton skinny GEMM for a small CUDA batch, or None where it does not apply."""
    if x.dtype not in (torch.bfloat16, torch.float16) or not _triton():
        return None
    from kiln.runtime.kernels import gemv

    k = x.shape[-1] // 2 if silu_and_mul else x.shape[-1]
    m = x.numel() // x.shape[-1] if k else 0
    n = weight.shape[0]
    ok, scale = _kernel_operands(x, weight, w, prefix, bias, k)
    if not (ok and 1 <= m <= gemv.GEMM_MAX_M and gemv.gemv_wins(m, n, k, weight.dtype == FP8)):
        return None
    x2 = x.reshape(m, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = gemv.gemv(x2, weight, scale, bias, silu_and_mul=silu_and_mul, out_dtype=out_dtype)
    return y.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str,
           silu_and_mul: bool = False, float_out: bool = False) -> torch.Tensor:
    """The linear layer ``prefix`` of a prepared weights dict (plain or FP8, see above).

    ``silu_and_mul``: x is a gate_up output [..., 2K]; the layer takes silu(gate) * up, fused
    into the small-batch GEMV where that runs, else through the Triton activation kernel.
    ``float_out``: the result in x's dtype, then ``.float()``; the small-batch GEMV stores
    that float32 value itself (no conversion kernel after it).
    """
    weight = w[prefix + ".weight"]
    bias = w.get(prefix + ".bias")
    if silu_and_mul and not (x.is_cuda and _silu_fusion_applies(x, weight)):
        x, silu_and_mul = _silu_and_mul(x), False  # the fused prologue loses here
    if x.is_cuda and weight.dtype != torch.float32:
        y = _small_m_gemv(x, weight, w, prefix, bias, silu_and_mul,
                          torch.float32 if float_out else None)
        if y is not None:
            return y
    if silu_and_mul:  # no small-batch GEMV here: the activation kernel, then the GEMM
        x = _silu_and_mul(x)
    if weight.dtype != FP8:
        y = F.linear(x, weight, bias)
    else:
        y = fp8_linear(x, weight, w[prefix + ".weight_scale"], w.get(prefix + ".input_scale"),
                       bias)
    return y.float() if float_out else y


def linear_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    w: dict[str, torch.Tensor], prefix: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual) * norm_weight), x + residual) on the Triton path: one
    kernel where the GEMV takes the norm as its prologue (``gemv.norm_prologue_applies``:
    batch 1 on CUDA), else the fused add + RMSNorm kernel, then ``linear``."""
    from kiln.runtime.kernels.rms_norm import fused_add_rms_norm

    weight = w[prefix + ".weight"]
    if x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and _triton():
        from kiln.runtime.kernels import gemv

        if gemv.norm_prologue_applies(x.shape[0], weight.shape[0], x.shape[1], weight.dtype):
            bias = w.get(prefix + ".bias")
            ok, scale = _kernel_operands(x, weight, w, prefix, bias, x.shape[1])
            if ok and x.stride(-1) == 1 and residual.stride(-1) == 1:
                return gemv.gemv_add_rms_norm(x, residual, norm_weight, eps, weight, scale,
                                              bias)
    xn, h = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(xn, w, prefix), h


def linear_residual_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, w: dict[str, torch.Tensor], prefix: str,
    norm_weight: torch.Tensor, eps: float, next_prefix: str, silu_and_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(h) * norm_weight, next_prefix), h) with h = linear(x, prefix) +
    residual: a projection, the residual add and the RMSNorm before the next projection
    (o_proj -> post-attention norm -> gate_up; down -> next layer's input norm -> qkv).

    At batch 1 on CUDA, where ``gemv.residual_fusion_form`` says so, two kernels: the first
    GEMV adds the residual and writes per-tile sums of squares in its epilogue, the second
    normalises as it loads (``"prologue"``) or runs on h * g and scales by 1 / rms(h) in
    its epilogue (``"epilogue"``); no norm kernel between them. Else linear, then
    ``linear_add_rms_norm``."""
    wa, wb = w[prefix + ".weight"], w[next_prefix + ".weight"]
    k_in = x.shape[-1] // 2 if silu_and_mul else x.shape[-1]
    if (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and _triton() and residual.shape == (x.shape[0], wa.shape[0])):
        from kiln.runtime.kernels import gemv

        form = gemv.residual_fusion_form(x.shape[0], wa.shape[0], k_in, wb.shape[0],
                                         wa.dtype, wb.dtype)
        if form is not None:
            if silu_and_mul and not _silu_fusion_applies(x, wa):
                x, silu_and_mul = _silu_and_mul(x), False  # the activation kernel first
            ba, bb = w.get(prefix + ".bias"), w.get(next_prefix + ".bias")
            ok_a, sa = _kernel_operands(x, wa, w, prefix, ba, k_in)
            ok_b, sb = _kernel_operands(residual, wb, w, next_prefix, bb, wa.shape[0])
            if (ok_a and ok_b and x.stride(-1) == 1 and residual.stride(-1) == 1
                    and norm_weight.dtype == x.dtype):
                if form == "epilogue":
                    h, hg, ss = gemv.gemv_add_residual_weighted(
                        x, wa, sa, ba, residual, norm_weight, silu_and_mul=silu_and_mul)
                    return gemv.gemv_rms_scaled(hg, ss, eps, wb, sb, bb), h
                h, ss = gemv.gemv_add_residual(x, wa, sa, ba, residual,
                                               silu_and_mul=silu_and_mul)
                return gemv.gemv_prenormed(h, ss, norm_weight, eps, wb, sb, bb), h
    y = linear(x, w, prefix, silu_and_mul=silu_and_mul)
    return linear_add_rms_norm(y, residual, norm_weight, eps, w, next_prefix)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from kiln.runtime.kernels.activation import silu_and_mul

    return silu_and_mul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], x.shape[-1] // 2)


def _silu_fusion_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    from kiln.runtime.kernels.gemv import silu_fusion_applies

    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return silu_fusion_applies(m, weight.shape[-1], weight.dtype == FP8)


def place_weights(
    weights: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Move weights to ``device``: FP8 tensors stay FP8, scales (``*_scale``) stay float32,
    everything else becomes ``dtype``."""
    out = {}
    for name, t in weights.items():
        if t.dtype == FP8 or name.endswith("_scale"):
            out[name] = t.to(device)
        else:
            out[name] = t.to(device, dtype)
    return out
