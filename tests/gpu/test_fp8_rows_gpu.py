"""FP8 activations quantized by the kernels that produce them, on CUDA (issue 47).

Run in its own process (not after tests/unit/test_kernels_*, which switch triton to its
CPU interpreter):  python -m pytest -q tests/gpu/test_fp8_rows_gpu.py

- the fused SiLU-and-mul / quant kernels' e4m3 rows and per-token scales equal the eager
  formulation bit for bit at the real shapes (the CPU interpreter's e4m3 cast has rounding
  faults, so only here is every element compared); the fused norms equal it up to their
  own y: a norm compiled with an e4m3 store sums its squares in another order than the
  plain norm (Triton picks the reduction's layout per kernel; H100, 2026-12-06: 1 element
  in 1.2M one bf16 ulp apart, float32 row scales ulps apart), so each element lies between
  the quantizations of y's near neighbours, and few are not of y itself;
- a Linear fed those rows (``Fp8Rows``) gives exactly what the same GEMM gives on the
  unfused path (the kernel's compute-dtype output, then fp8_quant), and captures in a graph;
- per-token W8A8 (row-wise _scaled_mm, gemv's W8A8 form) equals the dequantized product;
- a step of an FP8 engine launches one quant kernel per layer (the attention output's),
  none for the amax, and greedy tokens agree between the eager and the graph paths.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="TRITON_INTERPRET is set in this process; run tests/gpu alone"),
]

DEV = "cuda"
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
TOL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _rows(m: int, k: int, dtype=BF16) -> torch.Tensor:
    x = torch.randn(m, k, device=DEV) * torch.rand(m, 1, device=DEV) * 8
    x[m // 2] = 0
    return x.to(dtype)


def _check(q, s, y, static):
    """q, s == the eager quantization of y, bit for bit (pad rows: zeros, scale 1e-12)."""
    from kiln.runtime.fp8 import quantize_fp8, quantize_fp8_per_token

    m = y.shape[0]
    if static is None:
        ref, ref_s = quantize_fp8_per_token(y)
        assert torch.equal(s[:m], ref_s) and (s[m:] == 1e-12).all()
    else:
        ref = quantize_fp8(y, static)
        assert torch.equal(s, static.reshape(1))
    assert torch.equal(q[:m].view(torch.uint8), ref.view(torch.uint8))
    assert not q[m:].view(torch.uint8).any()


_MANTISSA = {BF16: 7, torch.float16: 10, torch.float32: 23}


def _ulp(y: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of y in y's dtype, as float32 (0 at 0)."""
    yf = y.float()
    _, e = torch.frexp(yf)
    return torch.where(yf == 0, 0.0, torch.ldexp(torch.ones_like(yf), e - 1 - _MANTISSA[y.dtype]))


def _check_norm(q, s, y, static):
    """A fused norm's q, s: the eager quantization of its own y, which may sit a few
    compute-dtype ulps from the plain norm's y (the sum of squares in another order moves
    1 / rms by an ulp or two: one ulp of y after rounding to bf16 / fp16, up to 4 in float32):
    each per-token scale lies between the scales of max|y| -+ that many ulps, each element
    between the quantizations of y -+ that many ulps under the kernel's scale (both are
    monotone), and at most 1 in 10,000 elements is not the quantization of y itself."""
    from kiln.runtime.fp8 import FP8_MAX, SCALE_MIN, fp8_scale_per_token, quantize_fp8

    m, k = y.shape[0], 4 if y.dtype == torch.float32 else 1
    yf, u = y.float(), k * _ulp(y)
    if static is None:
        amax = y.abs().amax(dim=-1, keepdim=True)
        au = k * _ulp(amax)
        lo, hi = (((amax.float() + d * au) * (1.0 / FP8_MAX)).clamp(min=SCALE_MIN) for d in (-1, 1))
        sk = s[:m]
        assert ((lo <= sk) & (sk <= hi)).all(), (sk - fp8_scale_per_token(y)).abs().max()
        assert (s[m:] == 1e-12).all()
    else:
        sk = static
        assert torch.equal(s, static.reshape(1))
    qk = q[:m].float()
    between = (quantize_fp8(yf - u, sk).float() <= qk) & (qk <= quantize_fp8(yf + u, sk).float())
    assert between.all(), int((~between).sum())
    exact = q[:m].view(torch.uint8) == quantize_fp8(yf, sk).view(torch.uint8)
    assert int((~exact).sum()) <= max(1, exact.numel() // 10_000), int((~exact).sum())
    assert not q[m:].view(torch.uint8).any()


@pytest.mark.parametrize("hidden, inter", [(4096, 14336), (576, 1536)])
@pytest.mark.parametrize("m", [1, 7, 16, 300])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_producers_write_the_eager_e4m3_rows(hidden, inter, m, dtype):
    from kiln.runtime.kernels import activation, fp8_quant, rms_norm

    static = torch.tensor(0.011, device=DEV)
    x, r = _rows(m, hidden, dtype), _rows(m, hidden, dtype)
    w = (1 + 0.3 * torch.randn(hidden, device=DEV)).to(dtype)
    y, h = rms_norm.fused_add_rms_norm(x, r, w, 1e-5)
    table = _rows(1000, hidden, dtype)
    ids = torch.randint(0, 1000, (m,), device=DEV)
    ye, he = rms_norm.embed_rms_norm(ids, table, w, 1e-5)
    gu = _rows(m, 2 * inter, dtype)
    ys = activation.silu_and_mul(gu)
    for scale in (None, static):
        q, s, h2 = rms_norm.fused_add_rms_norm_fp8(x, r, w, 1e-5, scale)
        assert torch.equal(h2, h)
        _check_norm(q, s, y, scale)
        q, s, h2 = rms_norm.embed_rms_norm_fp8(ids, table, w, 1e-5, scale)
        assert torch.equal(h2, he)
        _check_norm(q, s, ye, scale)
        _check(*activation.silu_and_mul_fp8(gu, scale), ys, scale)
        _check(*fp8_quant.quantize_fp8_padded(ys, scale), ys, scale)


def _fp8_layer(n: int, k: int, static: bool, per_row_weight: bool = False):
    from kiln.artifact.weights import quantize_per_row, quantize_per_tensor
    from kiln.runtime.layers.linear import Linear

    w = torch.randn(n, k, device=DEV) * k**-0.5
    q, s = quantize_per_row(w) if per_row_weight else quantize_per_tensor(w)
    weights = {"l.weight": q, "l.weight_scale": s}
    if static:
        weights["l.input_scale"] = torch.tensor(0.02, device=DEV)
    return Linear.from_weights(weights, "l"), w


@pytest.mark.parametrize("per_row", [False, True], ids=["w-tensor", "w-channel"])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
@pytest.mark.parametrize("m", [2, 16, 300])
def test_linear_on_kernel_quantized_rows_equals_the_unfused_path(static, m, per_row):
    """linear_add_rms_norm == the layer on the fused norm's e4m3 rows, bit for bit, and the
    plain path (the plain norm, fp8_quant, the same GEMM) but for at most 1 row in 100 (the
    fused norm's y may sit one ulp from the plain norm's: _check_norm); linear(silu_and_mul=
    True) == the plain kernel's output through the layer, bit for bit; both == the
    dequantized float32 product within FP8 error. 8B shapes: at M 2 the W8A8 GEMV (large
    weights), at 16 and 300 _scaled_mm (row-wise for per-token); weight scales per tensor or
    per output channel (llm-compressor's FP8_DYNAMIC checkpoints)."""
    from kiln.runtime.kernels import activation, rms_norm
    from kiln.runtime.layers.linear import Fp8Rows, linear_add_rms_norm

    qkv, _ = _fp8_layer(6144, 4096, static, per_row)
    down, _ = _fp8_layer(4096, 14336, static, per_row)
    assert qkv.activation_scheme == ("static" if static else "per-token")
    assert qkv.takes_fp8_rows(m, BF16, torch.device(DEV)) == (m > 1)
    x, r = _rows(m, 4096), _rows(m, 4096)
    g = (1 + 0.1 * torch.randn(4096, device=DEV)).to(BF16)
    y, h = linear_add_rms_norm(x, r, g, 1e-5, qkv)
    xn, h_ref = rms_norm.fused_add_rms_norm(x, r, g, 1e-5)
    assert torch.equal(h, h_ref)
    if m > 1:
        q, s, _ = rms_norm.fused_add_rms_norm_fp8(
            x, r, g, 1e-5, qkv.input_scale if static else None)
        assert torch.equal(y, qkv(Fp8Rows(q, s, m, BF16)))
    rows_off = int((y != qkv(xn)).any(dim=-1).sum())
    assert rows_off <= max(1, m // 100), rows_off
    gu = _rows(m, 2 * 14336)
    assert torch.equal(down(gu, silu_and_mul=True), down(activation.silu_and_mul(gu)))
    # the product: the layer's quantized activations times the dequantized weight
    from kiln.runtime.fp8 import quantize_fp8, quantize_fp8_per_token

    xq, xs = ((quantize_fp8(xn, qkv.input_scale), qkv.input_scale) if static
              else quantize_fp8_per_token(xn))
    ref = (xq.float() * xs) @ (qkv.weight.float() * qkv.weight_scale.reshape(-1, 1)).t()
    assert _rel(y, ref) < TOL


@pytest.mark.parametrize("m", [4, 16, 64])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_per_token_gemm_every_form(m, dtype):
    """fp8_gemm with per-token scales: gemv's W8A8 form (M <= 8, large weights), row-wise
    _scaled_mm (bf16), the float32 product scaled after (fp16, float32), per-tensor and
    per-row (the FP8 lm_head) weight scales: each == the dequantized float32 product."""
    from kiln.runtime.kernels.fp8_quant import quantize_fp8_padded

    for per_row in (False, True):
        layer, _ = _fp8_layer(14336, 4096, static=False, per_row_weight=per_row)
        x = _rows(m, 4096, dtype)
        q, s = quantize_fp8_padded(x)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (m, 14336)
        wd = layer.weight.float() * layer.weight_scale.reshape(-1, 1)
        ref = (q[:m].float() * s[:m]) @ wd.t()
        assert _rel(y, ref) < TOL, (m, dtype, per_row)


def test_fused_fp8_rows_capture_in_a_graph():
    """linear_add_rms_norm's per-token path replays in a CUDA graph and follows its inputs."""
    from kiln.runtime.layers.linear import linear_add_rms_norm

    layer, _ = _fp8_layer(28672, 4096, static=False)
    x, r = _rows(64, 4096), _rows(64, 4096)
    g = torch.ones(4096, device=DEV, dtype=BF16)
    linear_add_rms_norm(x, r, g, 1e-5, layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = linear_add_rms_norm(x, r, g, 1e-5, layer)
    x.copy_(_rows(64, 4096))
    graph.replay()
    y2, h2 = linear_add_rms_norm(x, r, g, 1e-5, layer)
    assert torch.equal(y, y2) and torch.equal(h, h2)


def _step_kernels(eng) -> dict[str, int]:
    """Kernel launches (name -> count) of the engine's next step, under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


@pytest.mark.parametrize("activations", ["static", "dynamic"])
def test_fp8_engine_step_quantizes_in_the_producers(tmp_path, activations):
    """A decode step of 16 requests (W8A8 on every linear) of a random FP8 engine launches
    no amax kernel and exactly one quant kernel per layer (the attention output, before
    o_proj); the norms and SiLU-and-mul write the other e4m3 inputs. Greedy tokens of the
    eager and graph paths agree."""
    from kiln.artifact.spec import QuantConfig
    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    q = QuantConfig("fp8", "fp8", scales={"activations": activations})
    spec = build_engine("random:tiny-llama", tmp_path / "e", dtype="bfloat16", progress=False,
                        quantization=q, max_batch_size=16, max_seq_len=128)
    layers = spec.model.num_layers
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[1 + i, 2 + i, 3 + i] for i in range(16)]
    outs = {}
    for graphs in (False, True):
        eng = LLMEngine.from_engine_dir(tmp_path / "e", RuntimeConfig(
            device=DEV, attention_backend="triton", cuda_graphs=graphs,
            async_scheduling=False))
        fp8 = [lin for lin in eng.model.linears.values() if lin.fp8]
        assert fp8 and all(lin.activation_scheme == ("static" if activations == "static"
                                                     else "per-token") for lin in fp8)
        outs[graphs] = [o.token_ids for o in eng.generate(prompts, params)]
        if not graphs:  # one step of 16 decodes, after the step of the 16 prefills
            for p in prompts:
                eng.add_request(p, params)
            eng.step()
            counts = _step_kernels(eng)
            assert not any("amax" in n for n in counts), counts
            assert sum(c for n, c in counts.items() if "_quant" in n) == layers, counts
            assert sum(c for n, c in counts.items() if "silu_and_mul_fp8" in n) == layers
            while eng.has_unfinished_requests():
                eng.step()
    assert outs[False] == outs[True]
