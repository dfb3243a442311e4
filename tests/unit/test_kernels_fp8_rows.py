"""FP8 activations quantized by the kernels that produce them (CPU, TRITON_INTERPRET=1):
the fused add + RMSNorm, the embedding + RMSNorm and SiLU-and-mul write e4m3 rows with a
static scale or one float32 scale per row (dynamic, per token), equal to the same kernel's
compute-dtype output quantized by the eager formulation (kiln/runtime/fp8.py): scales bit
for bit, values exactly (up to the interpreter's known e4m3 rounding faults, which the GPU
tests check: tests/gpu/test_fp8_rows_gpu.py). The W8A8 GEMV and ``fp8_gemm`` take per-token
scales; ``Linear`` knows its scheme."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
import torch

pytest.importorskip("triton")

from helpers import assert_e4m3_equal

from kiln.runtime.fp8 import (
    FP8,
    pad_rows,
    quantize_fp8,
    quantize_fp8_per_token,
)
from kiln.runtime.kernels import activation, fp8_quant, gemv, rms_norm
from kiln.runtime.kernels.testing import rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check_rows(q: torch.Tensor, s: torch.Tensor, y: torch.Tensor,
               static: torch.Tensor | None) -> None:
    """q, s (a kernel's e4m3 rows and scales) are the eager quantization of y [M, K], the
    compute-dtype value the kernel quantized: [M_pad, K] with zero pad rows; static: s is
    the scale as [1]; per token: [M_pad, 1], bit-exact, pad rows 1e-12."""
    m, k = y.shape
    m_pad = -(-m // 16) * 16
    assert q.shape == (m_pad, k) and q.dtype == FP8
    if static is None:
        ref, ref_s = quantize_fp8_per_token(y)
        assert s.shape == (m_pad, 1) and s.dtype == torch.float32
        assert torch.equal(s[:m], ref_s) and (s[m:] == 1e-12).all()
    else:
        ref, ref_s = quantize_fp8(y, static), static
        assert s.shape == (1,) and torch.equal(s, static.reshape(1))
    assert_e4m3_equal(q[:m], ref, (y.float() / ref_s).clamp(-448, 448))
    assert not q[m:].view(torch.uint8).any()


def rows(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[m, k] with rows of very different ranges (per-token scales differ), one row zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 8
    x[m // 2] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("static", [None, 0.013], ids=["per-token", "static"])
def test_fused_add_rms_norm_fp8(dtype, m, static):
    hidden = 48
    x, r = rows(m, hidden, dtype), rows(m, hidden, dtype, seed=1)
    g = torch.Generator().manual_seed(m)
    w = (0.3 * torch.randn(hidden, generator=g)).to(dtype)  # negative weights too
    scale = None if static is None else torch.tensor(static)
    q, s, h = rms_norm.fused_add_rms_norm_fp8(x, r, w, 1e-6, scale)
    y, h_plain = rms_norm.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, h_plain)  # the residual stream as the plain kernel writes it
    check_rows(q, s, y, scale)
    # and against the torch reference end to end (the norm's rounding aside)
    y_ref, _ = rms_norm.fused_add_rms_norm_ref(x, r, w, 1e-6)
    if static is None:
        assert rel_err(s[:m], quantize_fp8_per_token(y_ref)[1]) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [None, 0.005], ids=["per-token", "static"])
def test_embed_rms_norm_fp8(dtype, static):
    table = rows(40, 64, dtype)
    w = (0.3 * torch.randn(64, generator=torch.Generator().manual_seed(1))).to(dtype)
    ids = torch.tensor([3, 20, 20, 0, 39, 7, 40])  # 40: outside the table, a zero row
    scale = None if static is None else torch.tensor(static)
    q, s, h = rms_norm.embed_rms_norm_fp8(ids, table, w, 1e-5, scale)
    y, h_plain = rms_norm.embed_rms_norm(ids, table, w, 1e-5)
    assert torch.equal(h, h_plain) and h.shape == (7, 64)
    check_rows(q, s, y, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 4100], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("static", [None, 0.02], ids=["per-token", "static"])
def test_silu_and_mul_fp8(dtype, inter, static):
    m = 3 if inter > 4096 else 6
    x = rows(m, 2 * inter, dtype)
    scale = None if static is None else torch.tensor(static)
    q, s = activation.silu_and_mul_fp8(x, scale)
    check_rows(q, s, activation.silu_and_mul(x), scale)


@pytest.mark.parametrize("k", [48, 4100], ids=["one-pass", "two-pass"])
def test_quantize_fp8_padded_per_token_row_widths(k):
    x = rows(5, k, torch.bfloat16)
    q, s = fp8_quant.quantize_fp8_padded(x)
    check_rows(q, s, x, None)


def test_fp8_producers_check_their_arguments():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="scale has shape"):
        activation.silu_and_mul_fp8(x, torch.ones(2))
    with pytest.raises(ValueError, match="scale has dtype"):
        rms_norm.fused_add_rms_norm_fp8(x, x, torch.ones(16), 1e-6,
                                        torch.ones((), dtype=torch.float64))
    with pytest.raises(ValueError, match="even"):
        activation.silu_and_mul_fp8(torch.randn(2, 15))


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("split", [1, 2])
def test_gemv_w8a8_per_token_x_scales(m, split):
    """gemv's W8A8 form with one x scale per row (the padded per-token scales [M_pad, 1],
    pad rows unread) == the dequantized product, per-tensor and per-row weight scales."""
    n, k = 40, 96
    x = rows(m, k, torch.float32) + 0.1
    xq, xs = fp8_quant.quantize_fp8_padded(x)
    w = torch.randn(n, k) * 0.1
    cfg = {"BLOCK_N": 16, "BLOCK_K": 32, "USE_DOT": True, "num_warps": 4, "SPLIT_K": split}
    for ws in (torch.tensor(0.003), torch.rand(n) * 0.01 + 0.001):
        wq = (w / ws.reshape(-1, 1)).to(FP8)
        y = gemv.gemv(xq[:m], wq, ws, x_scale=xs, config=cfg)
        ref = (xq[:m].float() * xs[:m]) @ (wq.float() * ws.reshape(-1, 1)).t()
        assert rel_err(y, ref.to(torch.bfloat16)) < 1e-2
    with pytest.raises(ValueError, match="x_scale has shape"):
        gemv.gemv(xq[:m], wq, ws, x_scale=torch.ones(m, 2), config=cfg)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_row_weight", [False, True])
def test_fp8_gemm_per_token_equals_dequantized(out_dtype, per_row_weight):
    """``fp8_gemm`` on per-token e4m3 rows (torch's _scaled_mm runs on the CPU too): the
    row-wise _scaled_mm for bf16, the float32 product scaled after for the rest; static
    per-tensor x scales too. Equal to the dequantized float32 product."""
    from kiln.runtime.layers.linear import fp8_gemm, rowwise_weight_scale

    m, k, n = 5, 64, 48
    x = rows(m, k, torch.float32) + 0.05
    w = torch.randn(n, k) * 0.1
    ws = torch.rand(n) * 0.002 + 0.0005 if per_row_weight else w.abs().amax() / 448
    wq = (w / ws.reshape(-1, 1)).clamp(-448, 448).to(FP8)
    wd = wq.float() * ws.reshape(-1, 1)
    for static in (None, torch.tensor(0.02)):
        xq, xs = pad_rows(*quantize_fp8_per_token(x), 16) if static is None else (
            pad_rows(quantize_fp8(x, static), None, 16)[0], static.reshape(1))
        ref = (xq[:m].float() * (xs[:m] if static is None else xs)) @ wd.t()
        for scale_b in (None, rowwise_weight_scale(ws, n)):
            y = fp8_gemm(xq, xs, m, wq, ws.float(), out_dtype, scale_b)
            assert y.shape == (m, n) and y.dtype == out_dtype
            assert rel_err(y.float(), ref) < 1e-2


def test_linear_knows_its_activation_scheme():
    """A Linear's scheme follows its weights: no input_scale is per-token, static scales
    are kept as float32; on the CPU nothing takes the kernels' e4m3 rows."""
    from kiln.runtime.layers.linear import Linear

    wq = torch.randn(32, 16).to(FP8)
    w = {"a.weight": torch.randn(32, 16), "b.weight": wq, "b.weight_scale": torch.tensor(0.1),
         "c.weight": wq, "c.weight_scale": torch.tensor(0.1),
         "c.input_scale": torch.tensor(0.5, dtype=torch.float64)}
    a, b, c = (Linear.from_weights(w, p) for p in "abc")
    assert (a.activation_scheme, b.activation_scheme, c.activation_scheme) == (
        "none", "per-token", "static")
    assert c.input_scale.dtype == torch.float32
    assert b.scale_b is None  # made for CUDA weights only
    assert not b.takes_fp8_rows(64, torch.bfloat16, torch.device("cpu"))


@pytest.fixture
def fp8_rows_on_cpu(monkeypatch):
    """``Linear.takes_fp8_rows`` as on CUDA, here on the CPU: FP8 layers take the kernels'
    e4m3 rows (the interpreter's kernels, then torch's CPU _scaled_mm)."""
    from kiln.runtime.layers import linear as lin

    def takes(self, m, dtype, device):
        n, k = self.weight.shape
        return self.fp8 and lin.scaled_mm_ok(m, k, n)

    monkeypatch.setattr(lin.Linear, "takes_fp8_rows", takes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_layers_take_the_producers_rows(fp8_rows_on_cpu, dtype, static):
    """The wiring of the fused FP8 inputs: the add + RMSNorm before qkv, the embedding +
    RMSNorm before layer 0's qkv, SiLU-and-mul before down and the quant before o_proj each
    feed the layer the producer kernel's e4m3 rows with the layer's scheme (static scale or
    per token), and the layer returns their dequantized product (+ bias) in the compute
    dtype (the kernels themselves are checked against the eager formulation above)."""
    from kiln.runtime.kernels.rms_norm import fused_add_rms_norm_ref
    from kiln.runtime.layers.linear import Linear, linear_add_rms_norm, linear_embed_rms_norm

    g = torch.Generator().manual_seed(3)
    w = {}
    for name, (n, k) in {"qkv": (96, 64), "down": (64, 128)}.items():
        wt = torch.randn(n, k, generator=g) * 0.1
        w[name + ".weight"] = (wt / (wt.abs().max() / 448)).to(FP8)
        w[name + ".weight_scale"] = wt.abs().max() / 448
        w[name + ".bias"] = torch.randn(n, generator=g).to(dtype)
        if static:
            w[name + ".input_scale"] = torch.tensor(4.0 / 448)
    qkv, down = Linear.from_weights(w, "qkv"), Linear.from_weights(w, "down")
    assert qkv.activation_scheme == ("static" if static else "per-token")

    def product(layer, q, s, m):
        xs = s if static else s[:m]
        y = (q[:m].float() * xs) @ (layer.weight.float() * layer.weight_scale).t()
        return y + layer.bias.float()

    def check(y, layer, q, s):
        m = y.shape[0]
        assert y.dtype == dtype and s.shape == ((1,) if static else (q.shape[0], 1))
        assert rel_err(y, product(layer, q, s, m)) < 1e-2

    x, r = rows(21, 64, dtype), rows(21, 64, dtype, seed=2)
    gw = (1 + 0.2 * torch.randn(64, generator=g)).to(dtype)
    y, h = linear_add_rms_norm(x, r, gw, 1e-6, qkv)
    q, s, h2 = rms_norm.fused_add_rms_norm_fp8(x, r, gw, 1e-6, qkv.input_scale)
    assert torch.equal(h, h2) and rel_err(h, fused_add_rms_norm_ref(x, r, gw, 1e-6)[1]) < 1e-2
    check(y, qkv, q, s)
    table, ids = rows(30, 64, dtype), torch.tensor([4, 0, 29, 4, 17])
    y, h = linear_embed_rms_norm(ids, table, gw, 1e-6, qkv)
    q, s, _ = rms_norm.embed_rms_norm_fp8(ids, table, gw, 1e-6, qkv.input_scale)
    assert torch.equal(h, table[ids]) and y.shape == (5, 96)
    check(y, qkv, q, s)
    gu = rows(19, 256, dtype)
    check(down(gu, silu_and_mul=True), down, *activation.silu_and_mul_fp8(gu, down.input_scale))
    o = rows(19, 128, dtype)
    check(down(o), down, *fp8_quant.quantize_fp8_padded(o, down.input_scale))


@pytest.mark.parametrize("activations", ["static", "dynamic"])
def test_fused_fp8_engine_runs_on_kernel_rows(fp8_rows_on_cpu, tmp_path, activations):
    """A random FP8 engine (FP8 lm_head too) on the Triton backend's fused forward, every
    FP8 input from the kernels' e4m3 rows: greedy decoding runs, prefill and decode."""
    from kiln.artifact.spec import QuantConfig
    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    q = QuantConfig("fp8", "fp8", scales={"activations": activations}, lm_head="fp8")
    build_engine("random:tiny-llama", tmp_path / "e", dtype="float32", progress=False,
                 quantization=q)
    eng = LLMEngine.from_engine_dir(tmp_path / "e", RuntimeConfig(
        device="cpu", block_size=4, num_kv_blocks=128, max_num_tokens=32,
        attention_backend="triton"))
    assert eng.model.fused
    outs = eng.generate([[1, 2, 3], list(range(5, 25))],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    eng.blocks.check_all_free()
