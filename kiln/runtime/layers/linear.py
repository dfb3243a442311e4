"""Linear layers over prepared engine weights: plain (bf16/fp16/fp32) and FP8 E4M3.

An FP8 linear ``prefix`` has, in the weights dict (see kiln/artifact/weights.py):

    {prefix}.weight        [N, K] float8_e4m3fn    W ~= weight.float() * weight_scale
    {prefix}.weight_scale  [] float32              per-tensor dequantization scale, or [N]:
                                                   one per row (the FP8 lm_head)
    {prefix}.input_scale   [] float32              static activation scale (optional; absent
                                                   means dynamic per-token activation scales)
    {prefix}.bias          [N]                     optional, engine dtype

Activation scheme (``Linear.activation_scheme``), the same on every path:

- ``"static"``: x -> e4m3(x / s) with the calibrated per-tensor ``input_scale`` s
  (`kiln quantize` checkpoints, random FP8 engines);
- ``"per-token"`` (dynamic): each row (token) t gets its own s_t = max(max|x_t| * fp32(1 /
  448), 1e-12) and x_t -> e4m3(x_t / s_t) (``fp8.fp8_scale_per_token``); the product's row
  t is scaled by s_t (compressed-tensors dynamic checkpoints, the FP8 lm_head).

On CUDA the activations are quantized by the kernel that produces them where the GEMM takes
e4m3 (``Linear.takes_fp8_rows``): the fused add + RMSNorm before qkv and gate_up (and the
embedding + norm before layer 0's qkv), SiLU-and-mul before down, each writing e4m3 rows and,
dynamic, one float32 scale per row from the row it holds (kiln/runtime/kernels/rms_norm.py,
activation.py); an ``Fp8Rows`` carries them to the layer. Any other input (the attention
output before o_proj, the final norm's rows before an FP8 lm_head) is quantized by one
kernel (kiln/runtime/kernels/fp8_quant.py). All of them write [M rounded up to 16, K] with
zero pad rows. The GEMM (``fp8_gemm``) is ``torch._scaled_mm``: a per-tensor scale_a, or
per-token scales as its row-wise scale_a [M_pad, 1] with scale_b [1, N] (the weight's scale
per output column; row-wise needs a bf16 result on older torch / cuBLAS, so other compute
dtypes take the float32 product and scale it after). At M <= 8 on large weights
(``gemv_configs.w8a8_wins``) the Triton FP8 tensor-core skinny GEMM takes the same e4m3 rows
(per-tensor or per-row x scale in its epilogue). A per-row weight scale (the FP8 lm_head) is
applied in the GEMV's epilogue, as _scaled_mm's row-wise scale_b, or after a float32
_scaled_mm. The CPU and shapes _scaled_mm refuses quantize the same way in torch and run the
dequantized matmul, so the CPU result is the GPU result up to accumulation order.

Small batches on CUDA (decode: at most ``GEMV_MAX_M`` rows, bf16/fp16 activations) go to
the Triton skinny GEMM in kiln/runtime/kernels/gemv.py where it was measured faster than cuBLAS
(``gemv_configs.gemv_wins``). For FP8 weights that path is W8A16: activations stay bf16/fp16, the
e4m3 weights are widened in registers and accumulated in float32, and no activation scale is
used, which is at least as accurate as W8A8 (only the weights carry FP8 error). float32
weights, CPU and every other case keep the paths above unchanged.

Each layer is a ``Linear``, made once when the model is built (``Linear.from_weights``): its
tensors, and what its weight allows, decided then (whether the skinny GEMM and its fused
forms can take it, and for which activation dtypes). A call decides only what depends on
the batch: its rows against the measured rules of kiln/runtime/kernels/gemv_configs.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kiln.runtime import kernels
from kiln.runtime.fp8 import FP8, pad_rows, quantize_fp8, quantize_fp8_per_token
from kiln.runtime.kernels import gemv_configs
from kiln.runtime.kernels.gemv_configs import GEMV_DTYPES


def scaled_mm_ok(m: int, k: int, n: int) -> bool:
    """torch._scaled_mm shape rules: K and N multiples of 16 (M is padded by us)."""
    return k % 16 == 0 and n % 16 == 0 and m > 0


class Fp8Rows(NamedTuple):
    """An FP8 linear's input already quantized by the kernel that produced it (the fused
    RMSNorm, SiLU-and-mul, or fp8_quant): ``q`` [M_pad, K] e4m3 with zero rows past ``m``,
    ``scale`` the layer's static scale [1] or per-token scales [M_pad, 1] float32, ``m`` the
    real rows, ``dtype`` the compute dtype the layer returns."""

    q: torch.Tensor
    scale: torch.Tensor
    m: int
    dtype: torch.dtype


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T (+ bias) with FP8 weights; x [..., K] in the compute dtype, returns x.dtype.

    Activations are quantized per tensor with ``input_scale`` (static, from calibration) or
    per token with each row's own amax (dynamic), see the module docstring.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [M, K]
    n, k = weight.shape
    m = x2.shape[0]
    if x.is_cuda and scaled_mm_ok(m, k, n):
        xq, x_scale = _quantize_padded(x2, input_scale)  # [M rounded up to 16, K] e4m3
        y = fp8_gemm(xq, x_scale, m, weight, weight_scale, x.dtype)
    else:
        if input_scale is None:
            xq, x_scale = quantize_fp8_per_token(x2)  # [M, K] e4m3, [M, 1]
        else:
            x_scale = input_scale.float()
            xq = quantize_fp8(x2, x_scale)
        # The reference: the same quantized activations, dequantized, in the compute dtype
        # (float32 accumulation on CPU).
        acc = torch.float32 if x.device.type == "cpu" else x.dtype
        xd = xq.to(acc) * x_scale.to(acc)
        wd = weight.to(acc) * weight_scale.to(acc).reshape(-1, 1)  # per tensor or per row
        y = F.linear(xd, wd).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], n)


def rowwise_weight_scale(weight_scale: torch.Tensor, n: int) -> torch.Tensor:
    """A weight's scale as ``_scaled_mm``'s row-wise scale_b: [1, N] float32, contiguous."""
    return weight_scale.float().reshape(1, -1).expand(1, n).contiguous()


def fp8_gemm(
    xq: torch.Tensor, x_scale: torch.Tensor, m: int, weight: torch.Tensor,
    weight_scale: torch.Tensor, out_dtype: torch.dtype, scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [m, N] = (xq * x_scale) @ (weight * weight_scale)^T in ``out_dtype`` on CUDA, from
    e4m3 rows xq [M_pad, K] (rows past m zero) with a per-tensor x_scale ([1] or 0-dim) or
    per-token ones [M_pad, 1]. ``scale_b``: ``rowwise_weight_scale`` of the weight, made
    once by the caller (else here, for per-token x)."""
    n, k = weight.shape
    per_token = x_scale.numel() != 1
    if _w8a8_gemv_takes(m, n, k, out_dtype, weight_scale):
        # small M: the Triton FP8 tensor-core GEMM beats cuBLAS here
        return _kernels().gemv.gemv(xq[:m], weight, weight_scale.reshape(-1),
                                    x_scale=x_scale, out_dtype=out_dtype)
    # weight is [N, K] row-major: weight.t() is the column-major [K, N] _scaled_mm wants
    if not per_token and weight_scale.numel() == 1:
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale.reshape(()),
                                scale_b=weight_scale.float().reshape(()),
                                out_dtype=out_dtype)[:m]
    if per_token and out_dtype == torch.bfloat16:  # row-wise scales in the epilogue
        if scale_b is None:
            scale_b = rowwise_weight_scale(weight_scale, n)
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale_b,
                                out_dtype=out_dtype)[:m]
    # the float32 product, then x's scale per row (or per tensor) and the weight's per column
    one = torch.ones((), dtype=torch.float32, device=xq.device)
    y = torch._scaled_mm(xq, weight.t(), scale_a=one if per_token else x_scale.reshape(()),
                         scale_b=one, out_dtype=torch.float32)[:m]
    if per_token:
        y = y * x_scale[:m]
    return (y * weight_scale.float().reshape(1, -1)).to(out_dtype)


def _w8a8_gemv_takes(m: int, n: int, k: int, out_dtype: torch.dtype,
                     weight_scale: torch.Tensor) -> bool:
    """Whether gemv's W8A8 form takes this GEMM (``gemv_configs.w8a8_wins``)."""
    return (out_dtype in GEMV_DTYPES and weight_scale.dtype == torch.float32 and _triton()
            and gemv_configs.w8a8_wins(m, n, k))


def _quantize_padded(
    x2: torch.Tensor, input_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 of x2 [M, K] into [M rounded up to 16, K] with zero pad rows (older torch/cuBLAS
    want M % 16 too), and its scale (static [1]) or scales (per token [M_pad, 1]): one Triton
    kernel, eager without triton."""
    xs = None if input_scale is None else input_scale.float()
    if _triton():
        return _kernels().fp8_quant.quantize_fp8_padded(
            x2 if x2.stride(-1) == 1 else x2.contiguous(), xs)
    if xs is None:
        return pad_rows(*quantize_fp8_per_token(x2), 16)
    return pad_rows(quantize_fp8(x2, xs), None, 16)[0], xs.reshape(1)


@functools.cache
def _triton() -> bool:
    return kernels.available()


class _Kernels(NamedTuple):
    activation: ModuleType
    fp8_quant: ModuleType
    gemv: ModuleType
    rms_norm: ModuleType


@functools.cache
def _kernels() -> _Kernels:
    """The Triton kernel modules linear launches. Imported at their first use, not with this
    module: triton is an optional dependency, and whether its kernels run in the interpreter
    (TRITON_INTERPRET) is fixed when they are built, at import."""
    from kiln.runtime.kernels import activation, fp8_quant, gemv, rms_norm

    return _Kernels(activation, fp8_quant, gemv, rms_norm)


@dataclass(frozen=True, eq=False)
class Linear:
    """One linear layer of a prepared weights dict (plain or FP8, see above), with the
    kernel path its weight allows chosen once, at load (``from_weights``).

    ``gemv_dtypes``: the activation dtypes for which gemv's kernels take this weight on
    CUDA: a [N, K] row-major weight in that dtype, or FP8 with a float32 scale per tensor or
    per row; a bias in that dtype. Empty: never (a CPU weight, no triton, float32).
    ``scale_b``: a per-token FP8 layer's weight scale as _scaled_mm's row-wise scale_b
    [1, N] (CUDA only).
    """

    weight: torch.Tensor  # [N, K]
    bias: torch.Tensor | None = None  # [N]
    weight_scale: torch.Tensor | None = None  # FP8 only: [] or [N] float32
    input_scale: torch.Tensor | None = None  # FP8 only: static scale [] float32, or per-token
    gemv_dtypes: tuple[torch.dtype, ...] = ()
    scale_b: torch.Tensor | None = None  # [1, N] float32

    @classmethod
    def from_weights(cls, w: dict[str, torch.Tensor], prefix: str) -> Linear:
        """The layer ``prefix`` of ``w`` (``{prefix}.weight``, optional ``.bias``; FP8:
        ``.weight_scale``, optional ``.input_scale``)."""
        weight = w[prefix + ".weight"]
        bias = w.get(prefix + ".bias")
        scale = input_scale = scale_b = None
        if weight.dtype == FP8:
            scale, input_scale = w.get(prefix + ".weight_scale"), w.get(prefix + ".input_scale")
            if scale is None:
                raise ValueError(f"{prefix}.weight is FP8 but the weights have no "
                                 f"{prefix}.weight_scale (its dequantization scale)")
            if input_scale is not None:
                input_scale = input_scale.float()
            elif weight.is_cuda:
                scale_b = rowwise_weight_scale(scale, weight.shape[0])
        gemv_dtypes = _gemv_dtypes(weight, bias, scale) if weight.is_cuda and _triton() else ()
        return cls(weight, bias, scale, input_scale, gemv_dtypes, scale_b)

    @property
    def fp8(self) -> bool:
        return self.weight.dtype == FP8

    @property
    def activation_scheme(self) -> str:
        """How the layer quantizes its input: "static" (per tensor, ``input_scale``),
        "per-token" (dynamic, each row's own scale), "none" (not FP8)."""
        if not self.fp8:
            return "none"
        return "static" if self.input_scale is not None else "per-token"

    def gemv_takes(self, x: torch.Tensor, k: int) -> bool:
        """Whether gemv's kernels take this weight for x (its dtype, K = ``k`` columns)."""
        return x.dtype in self.gemv_dtypes and self.weight.shape[1] == k

    def takes_fp8_rows(self, m: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a call on ``m`` rows of ``dtype`` on ``device`` runs the FP8 GEMM on
        quantized activations (CUDA, triton, a shape _scaled_mm takes, no small-batch
        GEMV): then whatever produces its input may quantize it (``Fp8Rows``)."""
        n, k = self.weight.shape
        return (self.fp8 and device.type == "cuda" and _triton() and scaled_mm_ok(m, k, n)
                and not self._gemv_runs(m, dtype))

    def __call__(self, x: torch.Tensor | Fp8Rows, silu_and_mul: bool = False,
                 float_out: bool = False) -> torch.Tensor:
        """y = x @ W.T (+ bias), x [..., K] in the compute dtype, or an FP8 layer's input
        already quantized (``Fp8Rows``: y [m, N]).

        ``silu_and_mul``: x is a gate_up output [..., 2K]; the layer takes silu(gate) * up,
        fused into the small-batch GEMV where that runs, else through the Triton activation
        kernel (which writes the FP8 GEMM's e4m3 input itself). ``float_out``: the result in
        x's dtype, then ``.float()``; the small-batch GEMV stores that float32 value itself
        (no conversion kernel after it).
        """
        if isinstance(x, Fp8Rows):
            y = self._fp8_rows(x)
            return y.float() if float_out else y
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.takes_fp8_rows(m, x.dtype, x.device):
            # the activations' e4m3 rows from one kernel: the SiLU-and-mul, or the quant
            x2 = x.reshape(m, x.shape[-1])
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            kern = _kernels()
            q, s = (kern.activation.silu_and_mul_fp8(x2, self.input_scale) if silu_and_mul
                    else kern.fp8_quant.quantize_fp8_padded(x2, self.input_scale))
            y = self._fp8_rows(Fp8Rows(q, s, m, x.dtype)).reshape(*x.shape[:-1], -1)
            return y.float() if float_out else y
        if silu_and_mul and not (x.is_cuda and self._silu_fuses(x)):
            x, silu_and_mul = _silu_and_mul(x), False  # the fused prologue loses here
        if x.is_cuda:
            y = self._small_m_gemv(x, silu_and_mul, torch.float32 if float_out else None)
            if y is not None:
                return y
        if silu_and_mul:  # no small-batch GEMV here: the activation kernel, then the GEMM
            x = _silu_and_mul(x)
        if not self.fp8:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)
        return y.float() if float_out else y

    def _fp8_rows(self, x: Fp8Rows) -> torch.Tensor:
        """The FP8 GEMM on quantized activations (+ bias): [m, N] in x.dtype."""
        y = fp8_gemm(x.q, x.scale, x.m, self.weight, self.weight_scale, x.dtype, self.scale_b)
        return y if self.bias is None else y + self.bias

    def _gemv_runs(self, m: int, dtype: torch.dtype) -> bool:
        """Whether the small-batch GEMV takes m rows of ``dtype`` (``gemv_wins``)."""
        n, k = self.weight.shape
        return (dtype in self.gemv_dtypes and 1 <= m <= gemv_configs.GEMM_MAX_M
                and gemv_configs.gemv_wins(m, n, k, self.fp8))

    def _small_m_gemv(self, x: torch.Tensor, silu_and_mul: bool,
                      out_dtype: torch.dtype | None) -> torch.Tensor | None:
        """The Triton skinny GEMM for a small CUDA batch, or None where it does not apply."""
        k = x.shape[-1] // 2 if silu_and_mul else x.shape[-1]
        m = x.numel() // x.shape[-1] if k else 0
        if not (self.gemv_takes(x, k) and self._gemv_runs(m, x.dtype)):
            return None
        x2 = x.reshape(m, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = _kernels().gemv.gemv(x2, self.weight, self.weight_scale, self.bias,
                                 silu_and_mul=silu_and_mul, out_dtype=out_dtype)
        return y.reshape(*x.shape[:-1], self.weight.shape[0])

    def _silu_fuses(self, x: torch.Tensor) -> bool:
        """Whether the SiLU-and-mul of x goes into this layer's GEMV loads."""
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return gemv_configs.silu_fusion_applies(m, self.weight.shape[-1], self.fp8)


def _gemv_dtypes(weight: torch.Tensor, bias: torch.Tensor | None,
                 scale: torch.Tensor | None) -> tuple[torch.dtype, ...]:
    """``Linear.gemv_dtypes`` of a CUDA weight (its bias, its FP8 scale)."""
    fp8 = weight.dtype == FP8
    if weight.stride(-1) != 1 or (fp8 and not (scale is not None and scale.dtype == torch.float32
                                               and scale.numel() in (1, weight.shape[0]))):
        return ()
    return tuple(d for d in GEMV_DTYPES if (fp8 or weight.dtype == d)
                 and (bias is None or bias.dtype == d))


def linear_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    layer: Linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(rms_norm(x + residual) * norm_weight), x + residual) on the Triton path: one
    kernel where the GEMV takes the norm as its prologue (``norm_prologue_applies``: batch 1
    on CUDA), else the fused add + RMSNorm kernel (writing the layer's e4m3 rows where it
    takes them, ``Linear.takes_fp8_rows``), then the layer."""
    if (x.is_cuda and x.dim() == 2 and layer.gemv_takes(x, x.shape[1])
            and x.stride(-1) == 1 and residual.stride(-1) == 1
            and gemv_configs.norm_prologue_applies(x.shape[0], layer.weight.shape[0],
                                                   x.shape[1], layer.weight.dtype)):
        return _kernels().gemv.gemv_add_rms_norm(x, residual, norm_weight, eps, layer.weight,
                                                 layer.weight_scale, layer.bias)
    if layer.takes_fp8_rows(x.shape[0], x.dtype, x.device):  # the norm writes e4m3 rows
        q, s, h = _kernels().rms_norm.fused_add_rms_norm_fp8(x, residual, norm_weight, eps,
                                                             layer.input_scale)
        return layer(Fp8Rows(q, s, x.shape[0], x.dtype)), h
    xn, h = _kernels().rms_norm.fused_add_rms_norm(x, residual, norm_weight, eps)
    return layer(xn), h


def linear_embed_rms_norm(
    ids: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    layer: Linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(rms_norm(table[ids]) * norm_weight), table[ids]) on the Triton path: the
    embedding rows and the first norm in one kernel, which writes the layer's e4m3 rows
    where it takes them (``Linear.takes_fp8_rows``), then the layer."""
    rms_norm = _kernels().rms_norm
    if layer.takes_fp8_rows(ids.shape[0], table.dtype, table.device):
        q, s, h = rms_norm.embed_rms_norm_fp8(ids, table, norm_weight, eps, layer.input_scale)
        return layer(Fp8Rows(q, s, ids.shape[0], table.dtype)), h
    x, h = rms_norm.embed_rms_norm(ids, table, norm_weight, eps)
    return layer(x), h


def linear_residual_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, a: Linear, norm_weight: torch.Tensor, eps: float,
    b: Linear, silu_and_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b(rms_norm(h) * norm_weight), h) with h = a(x) + residual: a projection, the
    residual add and the RMSNorm before the next projection (o_proj -> post-attention norm
    -> gate_up; down -> next layer's input norm -> qkv).

    At batch 1 on CUDA, where ``gemv_configs.residual_fusion_form`` says so, two kernels: the
    first GEMV adds the residual and writes per-tile sums of squares in its epilogue, the
    second normalises as it loads (``"prologue"``) or runs on h * g and scales by 1 / rms(h)
    in its epilogue (``"epilogue"``); no norm kernel between them. Else a, then
    ``linear_add_rms_norm``."""
    wa, wb = a.weight, b.weight
    k_in = x.shape[-1] // 2 if silu_and_mul else x.shape[-1]
    if (x.is_cuda and x.dim() == 2 and x.dtype in GEMV_DTYPES and a.gemv_dtypes
            and residual.shape == (x.shape[0], wa.shape[0])):
        form = gemv_configs.residual_fusion_form(x.shape[0], wa.shape[0], k_in, wb.shape[0],
                                                 wa.dtype, wb.dtype)
        if form is not None:
            if silu_and_mul and not a._silu_fuses(x):
                x, silu_and_mul = _silu_and_mul(x), False  # the activation kernel first
            if (a.gemv_takes(x, k_in) and b.gemv_takes(residual, wa.shape[0])
                    and x.stride(-1) == 1 and residual.stride(-1) == 1
                    and norm_weight.dtype == x.dtype):
                gemv = _kernels().gemv
                if form == "epilogue":
                    h, hg, ss = gemv.gemv_add_residual_weighted(
                        x, wa, a.weight_scale, a.bias, residual, norm_weight,
                        silu_and_mul=silu_and_mul)
                    return gemv.gemv_rms_scaled(hg, ss, eps, wb, b.weight_scale, b.bias), h
                h, ss = gemv.gemv_add_residual(x, wa, a.weight_scale, a.bias, residual,
                                               silu_and_mul=silu_and_mul)
                return gemv.gemv_prenormed(h, ss, norm_weight, eps, wb, b.weight_scale,
                                           b.bias), h
    y = a(x, silu_and_mul=silu_and_mul)
    return linear_add_rms_norm(y, residual, norm_weight, eps, b)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    silu_and_mul = _kernels().activation.silu_and_mul
    return silu_and_mul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], x.shape[-1] // 2)


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
