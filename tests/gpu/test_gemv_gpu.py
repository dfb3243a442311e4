"""gemv (skinny GEMM) and the fused FP8 activation quant on CUDA at the real model shapes.

Run in its own process (not after tests/unit/test_kernels_*, which switch triton to its
CPU interpreter):  python -m pytest -q tests/gpu/test_gemv_gpu.py
Shapes (K -> N): llama-3-8b qkv 4096->6144, o_proj 4096->4096, gate_up 4096->28672,
down 14336->4096, lm_head 4096->128256; smollm2-135m 576->960, 576->576, 576->3072,
1536->576, 576->49152.
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
SHAPES = {  # name: (K, N)
    "8b-qkv": (4096, 6144), "8b-o": (4096, 4096), "8b-gate_up": (4096, 28672),
    "8b-down": (14336, 4096), "8b-lm_head": (4096, 128256),
    "smol-qkv": (576, 960), "smol-o": (576, 576), "smol-gate_up": (576, 3072),
    "smol-down": (1536, 576), "smol-lm_head": (576, 49152),
}
TOL = 1e-2  # bf16 output (one rounding of a float32 accumulation)


def _rel(out, ref):
    from kiln.runtime.kernels.testing import rel_err

    return rel_err(out, ref)


def _weights(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kiln.artifact.weights import quantize_per_tensor

    w = torch.randn(n, k, device=DEV) * k**-0.5
    q, s = quantize_per_tensor(w)
    return w.to(BF16), q, s


@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_real_shapes(shape):
    from kiln.runtime.kernels.gemv import gemv, gemv_ref

    k, n = SHAPES[shape]
    w, q, s = _weights(k, n)
    bias = torch.randn(n, device=DEV).to(BF16)
    for m in (1, 2, 4, 8):
        x = torch.randn(m, k, device=DEV).to(BF16)
        b = bias if m == 2 else None
        assert _rel(gemv(x, w, bias=b), gemv_ref(x, w, bias=b)) < TOL, (shape, m, "bf16")
        assert _rel(gemv(x, q, s, b), gemv_ref(x, q, s, b)) < TOL, (shape, m, "fp8")
    # fp16, and a strided x (a row slice of a wider buffer)
    x = torch.randn(3, k + 64, device=DEV).half()[:, :k]
    assert _rel(gemv(x, w.half()), gemv_ref(x, w.half())) < 2e-3


@pytest.mark.parametrize("shape", ["8b-lm_head", "smol-lm_head", "8b-qkv"])
def test_gemv_float32_logits_are_the_widened_bf16_result(shape):
    """out_dtype=float32 (the lm_head's logits, no .float() kernel): bit-identical to the
    bf16 result widened, at every M the small-batch path takes, bf16 and FP8 weights."""
    from kiln.runtime.kernels.gemv import gemv

    k, n = SHAPES[shape]
    w, q, s = _weights(k, n)
    for m in (1, 2, 8):
        x = torch.randn(m, k, device=DEV).to(BF16)
        for wt, sc in ((w, None), (q, s)):
            y = gemv(x, wt, sc, out_dtype=torch.float32)
            assert y.dtype == torch.float32
            assert torch.equal(y, gemv(x, wt, sc).float()), (shape, m, wt.dtype)


@pytest.mark.parametrize("shape", ["8b-lm_head", "smol-lm_head"])
def test_fp8_lm_head_per_row_scale_every_path(shape):
    """The FP8 lm_head (one scale per row) through ``linear`` at every M it meets: the W8A16
    GEMV (M 1, float32 logits), W8A8 (M 2-8, where it runs) and _scaled_mm (M 16, 64), each
    against the dequantized float32 product with the same activations."""
    from kiln.artifact.weights import quantize_per_row
    from kiln.runtime.layers.linear import Linear, fp8_linear

    k, n = SHAPES[shape]
    q, s = quantize_per_row(torch.randn(n, k, device=DEV) * k**-0.5)
    head = Linear.from_weights({"h.weight": q, "h.weight_scale": s}, "h")
    wd = q.float() * s[:, None]
    for m in (1, 4, 16, 64):
        x = torch.randn(m, k, device=DEV).to(BF16)
        y = head(x, float_out=True)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        if m == 1:  # W8A16: x as it is
            ref = x.float() @ wd.t()
        else:  # W8A8: x quantized per token (no input scale), as fp8_linear does everywhere
            xs = x.float().abs().amax(-1, keepdim=True) * (1 / 448)
            ref = ((x.float() / xs).clamp(-448, 448).to(FP8).float() * xs) @ wd.t()
        assert _rel(y, ref) < TOL, (shape, m)
        if m > 1:
            assert _rel(fp8_linear(x, q, s).float(), ref) < TOL, (shape, m)


@pytest.mark.parametrize("shape", ["8b-down", "smol-down"])
def test_gemv_silu_and_mul_prologue_real_shapes(shape):
    """The down projection with the activation fused in equals silu_and_mul then gemv (the
    same rounding), bf16 and FP8 weights, M = 1..8 (default configs: CUDA and tensor cores)."""
    from kiln.runtime.kernels.activation import silu_and_mul
    from kiln.runtime.kernels.gemv import gemv, gemv_ref

    k, n = SHAPES[shape]
    w, q, s = _weights(k, n)
    for m in (1, 2, 4, 8):
        gu = torch.randn(m, 2 * k, device=DEV).to(BF16) * 3
        for wt, sc in ((w, None), (q, s)):
            fused = gemv(gu, wt, sc, silu_and_mul=True)
            plain = gemv(silu_and_mul(gu), wt, sc)
            assert torch.equal(fused, plain) or _rel(fused, plain) < 1e-3, (shape, m)
            assert _rel(fused, gemv_ref(gu, wt, sc, silu_and_mul=True)) < TOL, (shape, m)


@pytest.mark.parametrize("shape", ["8b-down", "smol-down", "8b-o"])
def test_gemv_every_candidate_config(shape):
    """Every GEMV_CONFIGS entry and split-K variant (the tuner's candidates, bench_gemv's
    sweep) computes the same function, at M = 1 and, for 8b-down, M = 8."""
    from kiln.runtime.kernels.gemv import gemv, gemv_ref
    from kiln.runtime.kernels.gemv_configs import GEMV_CONFIGS, split_candidates

    k, n = SHAPES[shape]
    w, q, s = _weights(k, n)
    for m in (1, 8) if shape == "8b-down" else (1,):
        x = torch.randn(m, k, device=DEV).to(BF16)
        ref, ref8 = gemv_ref(x, w), gemv_ref(x, q, s)
        for cfg in GEMV_CONFIGS:
            if not cfg["USE_DOT"] and cfg["BLOCK_N"] * m * cfg["BLOCK_K"] > 128 * 32 * cfg[
                    "num_warps"]:
                continue  # spills (bench_gemv skips it too)
            for split in split_candidates(n, k, cfg):
                c = dict(cfg, SPLIT_K=split)
                assert _rel(gemv(x, w, config=c), ref) < TOL, (shape, m, c)
                assert _rel(gemv(x, q, s, config=c), ref8) < TOL, (shape, m, c, "fp8")


@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_w8a8_equals_scaled_mm(shape):
    """gemv with e4m3 x (W8A8) computes _scaled_mm's function on the same quantized operands,
    static (per-tensor) and dynamic (per-token, row-wise _scaled_mm) scales, M 1-8, at the
    default config and, at M = 1 and 8, every W8A8_CONFIGS x split candidate; fp8_linear at
    M <= 8 takes it where w8a8_wins says."""
    from kiln.runtime.kernels import gemv as gm
    from kiln.runtime.kernels import gemv_configs
    from kiln.runtime.kernels.fp8_quant import quantize_fp8_padded
    from kiln.runtime.layers.linear import fp8_linear

    k, n = SHAPES[shape]
    _, q, s = _weights(k, n)
    for m in (1, 2, 4, 8):
        x = torch.randn(m, k, device=DEV).to(BF16)
        for static in (torch.tensor(0.02, device=DEV), None):
            xq, xs = quantize_fp8_padded(x, static)
            if static is None:  # per token: [M_pad, 1] scales, row-wise
                ref = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.reshape(1, 1).expand(
                    1, n).contiguous(), out_dtype=BF16)[:m]
            else:
                ref = torch._scaled_mm(xq, q.t(), scale_a=xs.reshape(()),
                                       scale_b=s.reshape(()), out_dtype=BF16)[:m]
            assert _rel(gm.gemv(xq[:m], q, s, x_scale=xs), ref) < TOL, (shape, m)
            assert _rel(fp8_linear(x, q, s, static), ref) < TOL, (shape, m, "fp8_linear")
            if m in (1, 8):
                for cfg in gemv_configs.W8A8_CONFIGS:
                    for split in gemv_configs.split_candidates(n, k, cfg):
                        c = dict(cfg, SPLIT_K=split)
                        got = gm.gemv(xq[:m], q, s, x_scale=xs, config=c)
                        assert _rel(got, ref) < TOL, (shape, m, c, static is None)


def test_fp8_linear_small_m_w8a8_captures():
    """fp8_linear at M = 4 on an 8B-sized weight (the Triton W8A8 GEMM, dynamic scale, split
    K) replays in a CUDA graph and follows x."""
    from kiln.runtime.kernels import gemv_configs
    from kiln.runtime.layers.linear import fp8_linear

    k, n = 14336, 4096
    assert gemv_configs.w8a8_wins(4, n, k)
    _, q, s = _weights(k, n)
    x = torch.randn(4, k, device=DEV).to(BF16)
    fp8_linear(x, q, s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fp8_linear(x, q, s)
    x.copy_(torch.randn_like(x) * 7)
    g.replay()
    assert torch.equal(y, fp8_linear(x, q, s))


def test_gemv_cuda_graph_split_k():
    """Capturable (no host syncs): replay after changing x and the scale in place."""
    from kiln.runtime.kernels.gemv import gemv, gemv_ref

    k, n = 14336, 4096
    _, q, s = _weights(k, n)
    x = torch.randn(2, k, device=DEV).to(BF16)
    cfgs = [None, {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 4, "USE_DOT": True,
                   "num_warps": 4, "num_stages": 4}]
    for cfg in cfgs:
        gemv(x, q, s, config=cfg)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = gemv(x, q, s, config=cfg)
        x.copy_(torch.randn_like(x))
        s.mul_(1.5)
        g.replay()
        assert _rel(y, gemv_ref(x, q, s)) < TOL


def _pdl_chain(x, h, norm_w, wq, sq, w_up, w_down, s_down):
    """A decode-like chain of kiln kernels, each reading the one before: add+RMSNorm, a
    W8A16 gemv (the L2 prefetch path at M = 1), bf16 gate_up, SiLU-and-mul, FP8 down, and
    the split-K form."""
    from kiln.runtime.kernels.activation import silu_and_mul
    from kiln.runtime.kernels.gemv import gemv
    from kiln.runtime.kernels.rms_norm import fused_add_rms_norm

    xn, h2 = fused_add_rms_norm(x, h, norm_w, 1e-5)
    a = gemv(xn, wq, sq)
    up = gemv(xn, w_up)
    y = gemv(silu_and_mul(up), w_down, s_down)
    z = gemv(y[:, : wq.shape[1]], wq, sq, config={"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 4,
                                                  "USE_DOT": False, "num_warps": 4})
    return torch.cat([a, y, z, h2], dim=1)


@pytest.mark.parametrize("hints", ["lines", "sectors"])
@pytest.mark.parametrize("m", [1, 4])
def test_pdl_modes_are_bit_identical_in_a_captured_chain(m, hints, monkeypatch):
    """Programmatic dependent launch changes when kernels start, never what they compute:
    KILN_PDL 0 / 1 / 2, eager and replayed from a CUDA graph, give the same bits (a missing
    wait would show as a race here), with the GEMV's L2 hints per 128-byte line (shipped) and
    per 32-byte sector."""
    from kiln.runtime.kernels import _pdl, gemv_kernel

    monkeypatch.setattr(gemv_kernel, "PREFETCH_HINT_BYTES", 128 if hints == "lines" else 32)

    if not _pdl.supported():
        pytest.skip("PDL needs compute capability 9.0 and a triton with launch_pdl")
    torch.manual_seed(0)
    _, wq, sq = _weights(4096, 6144)
    w_up = (torch.randn(28672, 4096, device=DEV) * 4096**-0.5).to(BF16)
    _, w_down, s_down = _weights(14336, 4096)
    x = torch.randn(m, 4096, device=DEV).to(BF16)
    h = torch.randn(m, 4096, device=DEV).to(BF16)
    norm_w = torch.rand(4096, device=DEV).to(BF16) + 0.5
    args = (x, h, norm_w, wq, sq, w_up, w_down, s_down)
    with _pdl.forced(_pdl.OFF):
        ref = _pdl_chain(*args)
    for mode in (_pdl.ON, _pdl.PREFETCH):
        with _pdl.forced(mode):
            assert torch.equal(_pdl_chain(*args), ref), f"eager, KILN_PDL={mode}"
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                _pdl_chain(*args)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                out = _pdl_chain(*args)
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref), f"graph, KILN_PDL={mode}"


@pytest.mark.parametrize("shape", ["8b-qkv", "8b-gate_up", "smol-qkv", "smol-gate_up"])
@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_add_rms_norm_real_shapes(shape, fp8):
    """The add + RMSNorm prologue == fused_add_rms_norm then gemv at the real shapes (the
    new residual bit for bit), eager and replayed from a CUDA graph."""
    from kiln.runtime.kernels.gemv import gemv, gemv_add_rms_norm
    from kiln.runtime.kernels.rms_norm import fused_add_rms_norm

    k, n = SHAPES[shape]
    w, q, s = _weights(k, n)
    wt, sc = (q, s) if fp8 else (w, None)
    x = torch.randn(1, k, device=DEV).to(BF16)
    r = torch.randn(1, k, device=DEV).to(BF16)
    g = (torch.rand(k, device=DEV) + 0.5).to(BF16)
    xn, h_ref = fused_add_rms_norm(x, r, g, 1e-5)
    ref = gemv(xn, wt, sc)
    y, h = gemv_add_rms_norm(x, r, g, 1e-5, wt, sc)
    assert torch.equal(h, h_ref) and _rel(y, ref) < TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg, hg = gemv_add_rms_norm(x, r, g, 1e-5, wt, sc)
    x.copy_(torch.randn_like(x))
    graph.replay()
    xn, h_ref = fused_add_rms_norm(x, r, g, 1e-5)
    assert torch.equal(hg, h_ref) and _rel(yg, gemv(xn, wt, sc)) < TOL


PAIRS = {  # first GEMV (K, hidden), second GEMV (hidden, N), SiLU-and-mul into the first
    "8b-o>gate_up": (4096, 4096, 28672, False), "8b-down>qkv": (14336, 4096, 6144, True),
    "smol-o>gate_up": (576, 576, 3072, False), "smol-down>qkv": (1536, 576, 960, True),
}


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("form", ["prologue", "epilogue"])
def test_linear_residual_norm_linear_real_shapes(pair, fp8, form, monkeypatch):
    """The residual add and the statistics in the first GEMV's epilogue, the norm in the
    second's loads (prologue form) or its epilogue (1 / rms times the GEMV of h * g) ==
    linear, fused_add_rms_norm, linear (the new residual bit for bit), eager and replayed
    from a CUDA graph; the fused path really ran (two GEMV launches)."""
    from kiln.runtime.kernels import gemv, gemv_configs
    from kiln.runtime.layers.linear import Linear, linear_residual_norm_linear

    k, hidden, n, silu = PAIRS[pair]
    wa, qa, sa = _weights(k, hidden)
    wb, qb, sb = _weights(hidden, n)
    w = {"a.weight": qa if fp8 else wa, "b.weight": qb if fp8 else wb}
    if fp8:
        w |= {"a.weight_scale": sa, "b.weight_scale": sb}
    x = torch.randn(1, 2 * k if silu else k, device=DEV).to(BF16)
    r = torch.randn(1, hidden, device=DEV).to(BF16)
    g = (torch.rand(hidden, device=DEV) + 0.5).to(BF16)

    # every shape takes the form under test (8B's hidden the prologue, smollm2's the epilogue)
    monkeypatch.setattr(gemv_configs, "RESIDUAL_FUSION_MAX_HIDDEN",
                        1 << 20 if form == "prologue" else 0)
    second = "gemv_prenormed" if form == "prologue" else "gemv_rms_scaled"
    fusion_form = gemv_configs.residual_fusion_form
    a, b = Linear.from_weights(w, "a"), Linear.from_weights(w, "b")

    def run(fused: bool):  # unfused: GEMV, norm kernel, GEMV
        monkeypatch.setattr(gemv_configs, "residual_fusion_form",
                            fusion_form if fused else lambda *args: None)
        return linear_residual_norm_linear(x, r, a, g, 1e-5, b, silu_and_mul=silu)

    assert gemv_configs.residual_fusion_form(1, hidden, k, n, w["a.weight"].dtype,
                                     w["b.weight"].dtype) == form
    y_ref, h_ref = run(False)
    calls = []
    orig = getattr(gemv, second)
    monkeypatch.setattr(gemv, second, lambda *a, **kw: (calls.append(1), orig(*a, **kw))[1])
    y, h = run(True)
    assert calls and torch.equal(h, h_ref) and _rel(y, y_ref) < TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg, hg = run(True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    y_ref, h_ref = run(False)
    assert torch.equal(hg, h_ref) and _rel(yg, y_ref) < TOL
    if form == "epilogue":  # h * g is h * g rounded once (round to nearest even)
        a_scale = w.get("a.weight_scale")
        h2, hg2, _ = gemv.gemv_add_residual_weighted(x, w["a.weight"], a_scale, None, r, g,
                                                     silu_and_mul=silu)
        assert torch.equal(hg2, (h2.float() * g.float()).to(BF16))


@pytest.mark.parametrize("m", [1, 7, 16, 300])
@pytest.mark.parametrize("k", [576, 4096, 14336])
def test_fp8_quant_bit_exact(m, k):
    """Static and per-token quantization (one and two passes over a row) equal the eager
    formulation bit for bit: values, scales, zero pad rows with scale 1e-12."""
    from kiln.runtime.fp8 import quantize_fp8, quantize_fp8_per_token
    from kiln.runtime.kernels.fp8_quant import quantize_fp8_padded

    x = (torch.randn(m, k, device=DEV) * 3).to(BF16)
    x[0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])  # saturates with the static scale
    if m > 1:
        x[-1] = 0  # an all-zero row: scale 1e-12, zeros
    m_pad = -(-m // 16) * 16
    static = torch.tensor(0.37, device=DEV)
    for scale in (static, None):
        if scale is None:
            ref, ref_scale = quantize_fp8_per_token(x)
        else:
            ref, ref_scale = quantize_fp8(x, scale), scale.reshape(1)
        q, s = quantize_fp8_padded(x, scale)
        assert q.shape == (m_pad, k) and q.dtype == FP8
        assert torch.equal(q[:m].view(torch.uint8), ref.view(torch.uint8)), scale
        assert not q[m:].view(torch.uint8).any()  # pad rows zero
        if scale is None:
            assert s.shape == (m_pad, 1) and torch.equal(s[:m], ref_scale)
            assert (s[m:] == 1e-12).all()
        else:
            assert torch.equal(s, ref_scale)


def test_fp8_linear_fused_quant_matches_eager_and_captures():
    from kiln.artifact.weights import quantize_per_tensor
    from kiln.runtime.layers import linear as lin

    w = torch.randn(4096, 4096, device=DEV) * 4096**-0.5
    q, s = quantize_per_tensor(w)
    for m in (9, 64, 333):
        x = torch.randn(m, 4096, device=DEV).to(BF16)
        for xs in (None, x.abs().amax().float() / 448):
            y = lin.fp8_linear(x, q, s, xs)
            # the eager CUDA formulation (same quantized operands, same _scaled_mm)
            if xs is None:  # per token, row-wise
                xq, x_scale = lin.pad_rows(*lin.quantize_fp8_per_token(x), 16)
                ref = torch._scaled_mm(xq, q.t(), scale_a=x_scale,
                                       scale_b=lin.rowwise_weight_scale(s, 4096),
                                       out_dtype=BF16)[:m]
            else:
                xq = lin.pad_rows(lin.quantize_fp8(x, xs), None, 16)[0]
                ref = torch._scaled_mm(xq, q.t(), scale_a=xs.reshape(()),
                                       scale_b=s.reshape(()), out_dtype=BF16)[:m]
            assert torch.equal(y, ref)
    x = torch.randn(64, 4096, device=DEV).to(BF16)
    lin.fp8_linear(x, q, s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = lin.fp8_linear(x, q, s)
    x.copy_(torch.randn_like(x) * 5)
    g.replay()
    assert torch.equal(y, lin.fp8_linear(x, q, s))


def test_linear_dispatch_small_m():
    """linear(): bf16 and FP8 weights at M <= GEMV_MAX_M take gemv (W8A16 for FP8) and
    agree with F.linear / the dequantized reference; larger M keeps cuBLAS / _scaled_mm."""
    import torch.nn.functional as F

    from kiln.runtime.kernels import gemv_configs
    from kiln.runtime.layers.linear import Linear

    w, q, s = _weights(4096, 6144)
    weights = {"a.weight": w, "b.weight": q, "b.weight_scale": s,
               "b.input_scale": torch.tensor(0.02, device=DEV)}
    la, lb = Linear.from_weights(weights, "a"), Linear.from_weights(weights, "b")
    wd = (q.float() * s).to(BF16)
    for m in (1, 3, gemv_configs.GEMV_MAX_M, gemv_configs.GEMV_MAX_M + 1, 64):
        x = torch.randn(m, 4096, device=DEV).to(BF16)
        assert _rel(la(x), F.linear(x, w)) < TOL
        y8 = lb(x)
        assert y8.shape == (m, 6144) and y8.dtype == BF16
        tol = (TOL if m <= gemv_configs.GEMV_MAX_M and gemv_configs.gemv_wins(m, 6144, 4096, True)
               else 0.08)
        assert _rel(y8, F.linear(x, wd)) < tol  # W8A8 adds activation quant error
    x3 = torch.randn(1, 1, 4096, device=DEV).to(BF16)
    assert la(x3).shape == (1, 1, 6144)


@pytest.mark.parametrize("shape", ["8b-down", "smol-down"])
def test_linear_silu_and_mul_routes_by_k(shape, monkeypatch):
    """linear(silu_and_mul=True): the fused GEMV prologue where silu_fusion_applies, the
    activation kernel then gemv above it, cuBLAS past GEMV_MAX_M; all equal the eager MLP."""
    import torch.nn.functional as F

    from kiln.runtime.kernels import gemv as gm
    from kiln.runtime.kernels import gemv_configs
    from kiln.runtime.kernels.activation import silu_and_mul_ref
    from kiln.runtime.layers.linear import Linear

    k, n = SHAPES[shape]
    w, _, _ = _weights(k, n)
    seen = []
    real = gm.gemv
    monkeypatch.setattr(gm, "gemv", lambda *a, **kw: seen.append(kw.get("silu_and_mul"))
                        or real(*a, **kw))
    down = Linear.from_weights({"d.weight": w}, "d")
    for m in (1, 4, gemv_configs.GEMV_MAX_M + 1):
        gu = torch.randn(m, 2 * k, device=DEV).to(BF16)
        assert _rel(down(gu, silu_and_mul=True), F.linear(silu_and_mul_ref(gu), w)) < TOL
    fused = [gemv_configs.silu_fusion_applies(m, k, False) for m in (1, 4, 9)]
    # M = 1 and 4 through gemv; M = 9 through gemv's tensor-core tiles on smollm2's small
    # weights, through cuBLAS on llama-3-8b's
    assert seen == fused[:2] + (fused[2:] if gemv_configs.gemv_wins(9, n, k, False) else [])


@pytest.mark.parametrize("m", [9, 16, 84, 128])
@pytest.mark.parametrize("shape", ["smol-qkv", "smol-o", "smol-gate_up", "smol-down"])
def test_gemv_mid_m_real_shapes(shape, m):
    """Speculative-step batches (9..GEMM_MAX_M rows) on smollm2's projections: the default
    tensor-core config (split K on the deep ones) vs the float32 reference."""
    from kiln.runtime.kernels import gemv as gm

    k, n = SHAPES[shape]
    w, _, _ = _weights(k, n)
    x = torch.randn(m, k, device=DEV).to(BF16)
    assert _rel(gm.gemv(x, w), gm.gemv_ref(x, w)) < TOL
