"""Skinny GEMM (gemv) and FP8 activation quant kernels vs their torch references, on CPU
under TRITON_INTERPRET=1 (tiny shapes; the real shapes run in tests/gpu/test_gemv_gpu.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.kernels import fp8_quant, gemv, gemv_configs, tuned_configs
from kiln.runtime.kernels.testing import rel_err

FP8 = torch.float8_e4m3fn
# the interpreter truncates float32 -> bf16 casts (the GPU rounds to nearest)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
CUDA_CORE = gemv_configs._cfg(8, 32, False)
TENSOR_CORE = gemv_configs._cfg(16, 32, True, stages=2)


def _w(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    if dtype == FP8:
        return (torch.randn(n, k) * 40).to(FP8), torch.tensor(0.011)
    return torch.randn(n, k).to(dtype), None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", ["same", "fp8"])
@pytest.mark.parametrize("cfg", [CUDA_CORE, TENSOR_CORE, dict(CUDA_CORE, SPLIT_K=3),
                                 dict(TENSOR_CORE, SPLIT_K=2)], ids=["cc", "tc", "cc-sk", "tc-sk"])
def test_gemv_matches_reference(dtype, wdtype, cfg):
    # N not a multiple of BLOCK_N, K not a multiple of BLOCK_K, strided x rows, bias
    for m, n, k in ((1, 40, 96), (5, 33, 80)):
        w, s = _w(n, k, FP8 if wdtype == "fp8" else dtype)
        x = torch.randn(m, k + 16).to(dtype)[:, :k]
        b = torch.randn(n).to(dtype)
        y = gemv.gemv(x, w, s, b, config=cfg)
        assert y.shape == (m, n) and y.dtype == dtype
        assert rel_err(y, gemv.gemv_ref(x, w, s, b)) < TOL[dtype]


@pytest.mark.parametrize("wdtype", ["same", "fp8"])
@pytest.mark.parametrize("cfg", [None, TENSOR_CORE, dict(TENSOR_CORE, SPLIT_K=2)],
                         ids=["default", "tc", "tc-sk"])
def test_gemv_mid_m_tensor_core_tiles(wdtype, cfg):
    """9..GEMM_MAX_M rows (speculative steps): 16-row tiles on grid axis 2, the last one
    ragged; plain, with the SiLU prologue and with bias."""
    from kiln.runtime.kernels.activation import silu_and_mul

    dtype = torch.bfloat16
    for m, n, k in ((9, 40, 96), (37, 33, 80)):
        w, s = _w(n, k, FP8 if wdtype == "fp8" else dtype)
        x = torch.randn(m, k).to(dtype)
        b = torch.randn(n).to(dtype)
        y = gemv.gemv(x, w, s, b, config=cfg)
        assert y.shape == (m, n) and rel_err(y, gemv.gemv_ref(x, w, s, b)) < TOL[dtype]
        gu = torch.randn(m, 2 * k).to(dtype)
        assert torch.equal(gemv.gemv(gu, w, s, config=cfg, silu_and_mul=True),
                           gemv.gemv(silu_and_mul(gu), w, s, config=cfg))


def test_gemv_wins_mid_m_rule():
    """Past GEMV_MAX_M rows (speculative steps) linear() takes the tensor-core tiles up to one
    16-row block on any bf16 weight, and up to GEMM_MAX_M rows on small weights only (each
    block reads the weight again); cuBLAS for FP8, wide-and-shallow weights and past
    GEMM_MAX_M."""
    wins = gemv_configs.gemv_wins
    one, most = gemv_configs.GEMM_ONE_BLOCK_M, gemv_configs.GEMM_MAX_M
    # smollm2's qkv and gate_up (small): every speculative step size
    for m in (gemv_configs.GEMV_MAX_M + 1, one, one + 1, 84, most):
        assert wins(m, 960, 576, False) and wins(m, 3072, 576, False), m
    # Qwen2.5-1.5B's gate_up (27.5 M elements): one block only
    assert wins(9, 17920, 1536, False) and wins(one, 17920, 1536, False)
    assert not wins(one + 1, 17920, 1536, False) and not wins(84, 17920, 1536, False)
    assert not wins(9, 960, 576, True)  # FP8: W8A8 / _scaled_mm past GEMV_MAX_M
    assert not wins(9, 49152, 576, False)  # smollm2's lm_head: wide and shallow
    assert not wins(most + 1, 960, 576, False)


@pytest.fixture
def set_pdl_env(monkeypatch):
    """Set (or with None unset) KILN_PDL and drop the cached read (again after the test)."""
    from kiln.runtime import env

    def set_(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("KILN_PDL", raising=False)
        else:
            monkeypatch.setenv("KILN_PDL", value)
        env.pdl_mode.cache_clear()

    yield set_
    env.pdl_mode.cache_clear()


def test_pdl_mode_rules(monkeypatch, set_pdl_env):
    """PDL is off without a Hopper GPU (here: the interpreter), whatever KILN_PDL says; a bad
    KILN_PDL is one clear error where PDL is supported."""
    from kiln.runtime.kernels import _pdl

    set_pdl_env("2")
    assert _pdl.mode() == _pdl.OFF and _pdl.launch_kwargs() == {"PDL": False}
    monkeypatch.setattr(_pdl, "supported", lambda: True)
    assert _pdl.mode() == _pdl.PREFETCH and _pdl.prefetch()
    set_pdl_env(None)
    assert _pdl.mode() == _pdl.PREFETCH  # the default
    assert _pdl.launch_kwargs() == {"PDL": True, "launch_pdl": True}
    set_pdl_env("0")
    assert _pdl.mode() == _pdl.OFF
    with _pdl.forced(_pdl.ON):
        assert _pdl.mode() == _pdl.ON and not _pdl.prefetch()
    set_pdl_env("yes")
    with pytest.raises(ValueError, match="KILN_PDL='yes' must be 0"):
        _pdl.mode()
    with pytest.raises(ValueError, match="PDL mode 3"), _pdl.forced(3):
        pass


@pytest.mark.parametrize("wdtype", ["same", "fp8"])
@pytest.mark.parametrize("cfg", [CUDA_CORE, TENSOR_CORE, dict(CUDA_CORE, SPLIT_K=3),
                                 dict(TENSOR_CORE, SPLIT_K=2)], ids=["cc", "tc", "cc-sk", "tc-sk"])
def test_gemv_with_silu_and_mul_prologue(wdtype, cfg):
    """gemv(gate_up, W, silu_and_mul=True) == gemv(silu_and_mul(gate_up), W): the activation
    kernel's rounding, computed while loading (strided rows, ragged K, M = 1 and 5)."""
    from kiln.runtime.kernels.activation import silu_and_mul

    dtype = torch.bfloat16
    for m, n, k in ((1, 40, 96), (5, 33, 80)):
        w, s = _w(n, k, FP8 if wdtype == "fp8" else dtype)
        gu = (torch.randn(m, 2 * k + 8) * 3).to(dtype)[:, : 2 * k]
        y = gemv.gemv(gu, w, s, config=cfg, silu_and_mul=True)
        assert torch.equal(y, gemv.gemv(silu_and_mul(gu), w, s, config=cfg))
        # the interpreter truncates the two bf16 roundings of the activation too
        assert rel_err(y, gemv.gemv_ref(gu, w, s, silu_and_mul=True)) < 2 * TOL[dtype]
    with pytest.raises(ValueError, match="gate | up"):
        gemv.gemv(torch.randn(1, 9, dtype=dtype), torch.randn(4, 4, dtype=dtype),
                  silu_and_mul=True)


@pytest.mark.parametrize("cfg", [CUDA_CORE, TENSOR_CORE, dict(CUDA_CORE, SPLIT_K=3),
                                 dict(TENSOR_CORE, SPLIT_K=2)], ids=["cc", "tc", "cc-sk", "tc-sk"])
def test_gemv_per_row_weight_scale(cfg):
    """FP8 weights with one scale per row (the FP8 lm_head): W8A16 at M 1 and 5, W8A8, and a
    bad scale shape is refused."""
    from kiln.runtime.kernels.fp8_quant import quantize_fp8_padded

    n, k = 40, 96
    w, _ = _w(n, k, FP8)
    s = torch.rand(n) * 0.02 + 0.001  # [N]
    b = torch.randn(n).to(torch.bfloat16)
    for m in (1, 5):
        x = torch.randn(m, k).to(torch.bfloat16)
        y = gemv.gemv(x, w, s, b, config=cfg)
        ref = (x.float() @ (w.float() * s[:, None]).t() + b.float()).to(torch.bfloat16)
        assert rel_err(y, ref) < TOL[torch.bfloat16]
        assert rel_err(y, gemv.gemv_ref(x, w, s, b)) < TOL[torch.bfloat16]
    if cfg["USE_DOT"]:  # W8A8 takes tensor-core configs only
        x = torch.randn(3, k) * 3
        xq, xs = quantize_fp8_padded(x, torch.tensor(0.021))
        y = gemv.gemv(xq[:3], w, s, x_scale=xs, config=cfg)
        ref = ((xq[:3].float() * xs) @ (w.float() * s[:, None]).t()).to(torch.bfloat16)
        assert rel_err(y, ref) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="one per weight row"):
        gemv.gemv(torch.randn(1, k).to(torch.bfloat16), w, torch.ones(n - 1), config=cfg)


@pytest.mark.parametrize("wdtype", ["same", "fp8"])
@pytest.mark.parametrize("cfg", [CUDA_CORE, TENSOR_CORE, dict(CUDA_CORE, SPLIT_K=3),
                                 dict(TENSOR_CORE, SPLIT_K=2)], ids=["cc", "tc", "cc-sk", "tc-sk"])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_float32_out_is_the_widened_result(wdtype, cfg, m):
    """out_dtype=float32 (the logits): exactly ``.float()`` of the bf16 result."""
    x = torch.randn(m, 80).to(torch.bfloat16)
    w, s = _w(50, 80, FP8 if wdtype == "fp8" else torch.bfloat16)
    b = torch.randn(50).to(torch.bfloat16)
    y = gemv.gemv(x, w, s, b, config=cfg, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert torch.equal(y, gemv.gemv(x, w, s, b, config=cfg).float())
    with pytest.raises(ValueError, match="out_dtype"):
        gemv.gemv(x, w, s, b, config=cfg, out_dtype=torch.float16)


def test_linear_float_out_off_the_gemv_path():
    from kiln.runtime.layers.linear import Linear

    x = torch.randn(2, 24).to(torch.bfloat16)
    layer = Linear.from_weights({"p.weight": torch.randn(10, 24).to(torch.bfloat16)}, "p")
    y = layer(x, float_out=True)
    assert y.dtype == torch.float32 and torch.equal(y, layer(x).float())


@pytest.mark.parametrize("m", [1, 2, 8])
def test_gemv_default_config_and_one_element_scale(m):
    w, s = _w(48, 128, FP8)
    x = torch.randn(m, 128, dtype=torch.bfloat16)
    y = gemv.gemv(x, w, s.reshape(1))
    assert rel_err(y, gemv.gemv_ref(x, w, s)) < TOL[torch.bfloat16]
    wb = torch.randn(48, 128, dtype=torch.bfloat16)
    assert rel_err(gemv.gemv(x, wb), gemv.gemv_ref(x, wb)) < TOL[torch.bfloat16]


def test_gemv_default_config_rule():
    for m in range(1, gemv_configs.GEMV_MAX_M + 1):
        for n, k in ((6144, 4096), (4096, 14336), (576, 1536), (128256, 4096)):
            for fp8 in (False, True):
                cfg = gemv_configs.check_config(gemv_configs.default_config(m, n, k, fp8))
                assert cfg["SPLIT_K"] * cfg["BLOCK_K"] <= 2 * k


def test_gemv_asks_the_tuning_table(monkeypatch):
    asked = []

    def lookup(kernel, key):
        asked.append((kernel, key))
        return dict(CUDA_CORE, SPLIT_K=2)

    monkeypatch.setattr(tuned_configs, "lookup", lookup)
    w, s = _w(24, 64, FP8)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = gemv.gemv(x, w, s)
    assert rel_err(y, gemv.gemv_ref(x, w, s)) < TOL[torch.bfloat16]
    wb = torch.randn(24, 64, dtype=torch.float16)
    gemv.gemv(x.half(), wb)
    assert asked == [("gemv", "3x24x64:fp8"), ("gemv", "3x24x64:float16")]
    assert gemv_configs.tuning_key(1, 2, 3, torch.bfloat16) == "1x2x3:bfloat16"


def test_gemv_untuned_takes_the_default_config():
    tuned_configs.clear()
    assert gemv_configs.resolve_config(None, 1, 8, 64, torch.bfloat16) == \
        gemv_configs.check_config(gemv_configs.default_config(1, 8, 64, False))
    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    assert rel_err(gemv.gemv(x, w), gemv.gemv_ref(x, w)) < TOL[torch.bfloat16]


def test_gemv_wrapper_errors():
    bf = torch.bfloat16
    x, w = torch.randn(2, 32, dtype=bf), torch.randn(16, 32, dtype=bf)
    w8, s = _w(16, 32, FP8)
    cases = [
        ({"x": x.float(), "weight": w}, "x has dtype"),
        ({"x": x, "weight": w.half()}, "weight has dtype"),
        ({"x": x, "weight": torch.randn(16, 31, dtype=bf)}, "weight has shape"),
        ({"x": x[0], "weight": w}, "x must have 2 dims"),
        ({"x": torch.randn(129, 32, dtype=bf), "weight": w}, "x has 129 rows"),
        ({"x": torch.randn(9, 32, dtype=bf), "weight": w, "config": CUDA_CORE},
         "x has 9 rows; CUDA-core configs"),
        ({"x": torch.randn(0, 32, dtype=bf), "weight": w}, "x has 0 rows"),
        ({"x": x, "weight": w.to("meta")}, "weight is on meta"),
        ({"x": x, "weight": w, "bias": torch.randn(15, dtype=bf)}, "bias has shape"),
        ({"x": x, "weight": w, "bias": torch.randn(16)}, "bias has dtype"),
        ({"x": x, "weight": w8}, "weight_scale is required"),
        ({"x": x, "weight": w8, "weight_scale": s.double()}, "weight_scale has dtype"),
        ({"x": x, "weight": w8, "weight_scale": torch.ones(2)}, "weight_scale has shape"),
        ({"x": x, "weight": w8, "weight_scale": s.to("meta")}, "weight_scale is on meta"),
        ({"x": x, "weight": w, "weight_scale": s}, "weight_scale is only for FP8"),
        ({"x": x, "weight": w, "config": {"BLOCK_N": 12, "BLOCK_K": 32}}, "BLOCK_N=12"),
        ({"x": x, "weight": w, "config": {"BLOCK_N": 8, "BLOCK_K": 32, "USE_DOT": True}},
         "USE_DOT needs"),
        ({"x": x, "weight": w, "config": {"BLOCK_N": 8, "BLOCK_K": 32, "TILE": 2}}, "only"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            gemv.gemv(**kwargs)


def _e4m3_grid(m: int, k: int) -> torch.Tensor:
    """Random values on the e4m3 grid (x / scale is exact, no rounding), with 448 in it."""
    q = (torch.randn(m, k) * 60).to(FP8).float()
    q[0, 0] = -448.0
    return q


@pytest.mark.parametrize("m", [1, 5, 16, 21])
def test_fp8_quant_static_and_dynamic(m):
    from helpers import assert_e4m3_equal

    k = 48
    m_pad = -(-m // 16) * 16
    # exact: values whose quotient is on the e4m3 grid (power-of-two scale), bf16 input
    x = (_e4m3_grid(m, k) * 0.25).to(torch.bfloat16)
    q, s = fp8_quant.quantize_fp8_padded(x, torch.tensor(0.25))
    rq, rs = fp8_quant.quantize_fp8_padded_ref(x, torch.tensor(0.25))
    assert q.shape == (m_pad, k) and q.dtype == FP8
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))  # pad rows zero too
    assert s.shape == (1,) and torch.equal(s, rs)
    # dynamic: per token, each row's scale bit-exact (pad rows 1e-12), values as the
    # reference's up to the interpreter's e4m3 rounding faults (rows of different ranges)
    x = (torch.randn(m, k) * torch.rand(m, 1) * 10).to(torch.bfloat16)
    q, s = fp8_quant.quantize_fp8_padded(x)
    rq, rs = fp8_quant.quantize_fp8_padded_ref(x)
    assert q.shape == (m_pad, k) and s.shape == (m_pad, 1) and s.dtype == torch.float32
    assert torch.equal(s, rs) and (s[m:] == 1e-12).all()
    assert_e4m3_equal(q[:m], rq[:m], (x.float() / rs[:m]).clamp(-448, 448))
    assert (q.float()[m:] == 0).all()
    # rounding and saturation: within the interpreter's e4m3 rounding (see
    # test_reshape_and_cache_fp8), against the reference
    x = torch.randn(m, k) * 3
    x[0, 1] = 1e4
    q, s = fp8_quant.quantize_fp8_padded(x, torch.tensor(0.5))
    rq, _ = fp8_quant.quantize_fp8_padded_ref(x, torch.tensor(0.5))
    assert q.float()[0, 1] == 448
    assert (q.float() - rq.float()).abs().max() <= rq.float().abs().max() / 16


def test_fp8_quant_errors():
    with pytest.raises(ValueError, match="x has dtype"):
        fp8_quant.quantize_fp8_padded(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale has shape"):
        fp8_quant.quantize_fp8_padded(torch.ones(2, 16), torch.ones(2))
    with pytest.raises(ValueError, match="scale has dtype"):
        fp8_quant.quantize_fp8_padded(torch.ones(2, 16), torch.ones((), dtype=torch.float64))


def test_linear_silu_and_mul_off_the_gemv_path():
    """linear(silu_and_mul=True) where no GEMV runs (CPU here, M > 8 or long K on CUDA):
    the activation kernel, then the plain linear."""
    from kiln.runtime.kernels.activation import silu_and_mul_ref
    from kiln.runtime.layers import linear as lin

    weights = {"d.weight": torch.randn(16, 32)}
    gu = torch.randn(3, 64)
    want = torch.nn.functional.linear(silu_and_mul_ref(gu), weights["d.weight"])
    layer = lin.Linear.from_weights(weights, "d")
    assert rel_err(layer(gu, silu_and_mul=True), want) < 1e-5


def test_linear_on_cpu_never_takes_the_kernels(monkeypatch):
    from kiln.runtime.layers import linear as lin

    def boom(*a, **k):
        raise AssertionError("CPU must keep the torch path")

    monkeypatch.setattr(gemv, "gemv", boom)
    monkeypatch.setattr(fp8_quant, "quantize_fp8_padded", boom)
    w8, s = _w(16, 32, FP8)
    weights = {"a.weight": torch.randn(16, 32, dtype=torch.bfloat16), "b.weight": w8,
               "b.weight_scale": s}
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    for prefix in ("a", "b"):
        layer = lin.Linear.from_weights(weights, prefix)
        assert layer.gemv_dtypes == () and layer(x).shape == (1, 16)


@pytest.mark.parametrize("cfg", [TENSOR_CORE, dict(TENSOR_CORE, SPLIT_K=2),
                                 gemv_configs.w8a8_config(1, 40, 96)],
                         ids=["tc", "tc-sk", "default"])
def test_gemv_w8a8_e4m3_x(cfg):
    """W8A8: e4m3 x (quantize_fp8_padded's rows, the pad rows unread) with x_scale times e4m3
    weights == the dequantized product, in out_dtype (ragged N and K, bias, M = 1 and 5)."""
    from kiln.runtime.kernels.fp8_quant import quantize_fp8_padded

    for m, n, k in ((1, 40, 96), (5, 33, 80)):
        w, s = _w(n, k, FP8)
        x = torch.randn(m, k) * 3
        xq, xs = quantize_fp8_padded(x, torch.tensor(0.021))
        for out in (torch.bfloat16, torch.float16):
            b = torch.randn(n).to(out)
            y = gemv.gemv(xq[:m], w, s, b, x_scale=xs, out_dtype=out, config=cfg)
            ref = ((xq[:m].float() * xs) @ (w.float() * s).t() + b.float()).to(out)
            assert y.shape == (m, n) and y.dtype == out
            assert rel_err(y, ref) < TOL[out]


def test_gemv_w8a8_errors():
    w8, s = _w(16, 32, FP8)
    xq = torch.randn(2, 32).to(FP8)
    xs = torch.tensor([0.5])
    cases = [
        ({"x": xq, "weight": w8, "weight_scale": s, "x_scale": xs, "config": CUDA_CORE},
         "tensor-core tiles only"),
        ({"x": xq, "weight": torch.randn(16, 32, dtype=torch.bfloat16), "x_scale": xs},
         "weight has dtype"),
        ({"x": torch.randn(2, 32, dtype=torch.bfloat16), "weight": w8, "weight_scale": s,
          "x_scale": xs}, "x has dtype"),
        ({"x": xq, "weight": w8, "weight_scale": s, "x_scale": torch.ones(2)},
         "x_scale has shape"),
        ({"x": xq, "weight": w8, "x_scale": xs}, "weight_scale is required"),
        ({"x": xq, "weight": w8, "weight_scale": s, "x_scale": xs, "out_dtype": torch.float32},
         "out_dtype"),
        ({"x": torch.randn(9, 32).to(FP8), "weight": w8, "weight_scale": s, "x_scale": xs},
         "x has 9 rows"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            gemv.gemv(**kwargs)


def test_gemv_w8a8_default_config_rule():
    assert not gemv_configs.w8a8_wins(1, 576, 576) and gemv_configs.w8a8_wins(8, 28672, 4096)
    assert gemv_configs.w8a8_wins(2, 4096, 14336) and not gemv_configs.w8a8_wins(8, 6144, 4096)
    assert not gemv_configs.w8a8_wins(gemv_configs.GEMV_MAX_M + 1, 28672, 4096)
    for m in range(1, gemv_configs.GEMV_MAX_M + 1):
        for n, k in ((6144, 4096), (4096, 14336), (28672, 4096), (4096, 4096)):
            cfg = gemv_configs.check_config(gemv_configs.w8a8_config(m, n, k))
            assert cfg["USE_DOT"] and cfg["SPLIT_K"] * cfg["BLOCK_K"] <= k


def test_bench_environment_records_the_pdl_mode(monkeypatch, set_pdl_env):
    """Bench reports say which KILN_PDL mode the CUDA kernels ran with (None off CUDA)."""
    from kiln.bench import report
    from kiln.runtime.kernels import _pdl

    assert report._pdl_mode("cpu") is None
    assert report._pdl_mode("cuda") == _pdl.OFF  # the interpreter: no PDL
    monkeypatch.setattr(_pdl, "supported", lambda: True)
    set_pdl_env("1")
    assert report._pdl_mode("cuda:0") == _pdl.ON


@pytest.mark.parametrize("wdtype", ["same", "fp8"])
@pytest.mark.parametrize("cfg", [CUDA_CORE, dict(CUDA_CORE, SPLIT_K=3)], ids=["cc", "cc-sk"])
@pytest.mark.parametrize("k", [96, 80])  # even and ragged K tiles
def test_gemv_add_rms_norm_equals_norm_then_gemv(wdtype, cfg, k):
    """One kernel == fused_add_rms_norm then gemv: the same new residual bit for bit, the
    same product (the norm computed per program, the residual written once)."""
    from kiln.runtime.kernels.rms_norm import fused_add_rms_norm

    dtype = torch.bfloat16
    n = 40
    w, s = _w(n, k, FP8 if wdtype == "fp8" else dtype)
    x = torch.randn(1, k).to(dtype)
    res = torch.randn(1, k).to(dtype)
    g = (torch.rand(k) + 0.5).to(dtype)
    b = torch.randn(n).to(dtype)
    y, h = gemv.gemv_add_rms_norm(x, res, g, 1e-5, w, s, b, config=cfg)
    xn, h_ref = fused_add_rms_norm(x, res, g, 1e-5)
    assert torch.equal(h, h_ref)
    assert rel_err(y, gemv.gemv(xn, w, s, b, config=cfg)) < 1e-2
    assert rel_err(y, gemv.gemv_ref(xn, w, s, b)) < TOL[dtype]


def test_gemv_add_rms_norm_errors():
    bf = torch.bfloat16
    x, r, g = torch.randn(1, 32, dtype=bf), torch.randn(1, 32, dtype=bf), torch.ones(32, dtype=bf)
    w = torch.randn(16, 32, dtype=bf)
    cases = [
        ((torch.randn(2, 32, dtype=bf), torch.randn(2, 32, dtype=bf), g, 1e-5, w), {},
         "x has 2 rows; gemv_add_rms_norm takes one"),
        ((x, torch.randn(1, 31, dtype=bf), g, 1e-5, w), {}, "residual has shape"),
        ((x, r, torch.ones(32), 1e-5, w), {}, "norm_weight has dtype"),
        ((x, r, g, 1e-5, w), {"config": TENSOR_CORE}, "CUDA-core tiles only"),
    ]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            gemv.gemv_add_rms_norm(*args, **kw)


def _residual_pair(wdtype: str, silu: bool, k: int):
    """x, the two GEMVs' weights and scales, the residual, the norm weight and the biases of
    a projection -> + residual -> RMSNorm -> projection at hidden 44, N 40 (ragged BLOCK_N
    tiles in both GEMVs)."""
    dtype = torch.bfloat16
    hidden, n_out = 44, 40
    wa, sa = _w(hidden, k, FP8 if wdtype == "fp8" else dtype)
    wb, sb = _w(n_out, hidden, FP8 if wdtype == "fp8" else dtype)
    x = torch.randn(1, 2 * k if silu else k).to(dtype)
    res = torch.randn(1, hidden).to(dtype)
    g = (torch.rand(hidden) + 0.5).to(dtype)
    ba, bb = torch.randn(hidden).to(dtype), torch.randn(n_out).to(dtype)
    return x, wa, sa, wb, sb, res, g, ba, bb


@pytest.mark.parametrize("wdtype", ["same", "fp8"])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("k", [96, 80])  # even and ragged K tiles of the first GEMV
def test_gemv_add_residual_then_prenormed_equals_gemv_norm_gemv(wdtype, silu, k):
    """gemv_add_residual -> gemv_prenormed == gemv -> fused_add_rms_norm -> gemv: the same
    new residual bit for bit (the add in the first GEMV's epilogue), the same product (the
    statistics from its per-tile partial sums instead of a norm kernel)."""
    from kiln.runtime.kernels.activation import silu_and_mul
    from kiln.runtime.kernels.rms_norm import fused_add_rms_norm

    dtype = torch.bfloat16
    x, wa, sa, wb, sb, res, g, ba, bb = _residual_pair(wdtype, silu, k)
    h, ss = gemv.gemv_add_residual(x, wa, sa, ba, res, silu_and_mul=silu, config=CUDA_CORE)
    assert ss.shape == (6,) and ss.dtype == torch.float32  # cdiv(44, BLOCK_N 8) tiles
    y = gemv.gemv_prenormed(h, ss, g, 1e-5, wb, sb, bb, config=CUDA_CORE)
    a = gemv.gemv(x, wa, sa, ba, silu_and_mul=silu, config=CUDA_CORE)
    xn, h_ref = fused_add_rms_norm(a, res, g, 1e-5)
    assert torch.equal(h, h_ref)
    assert torch.allclose(ss.sum(), h_ref.float().pow(2).sum(), rtol=1e-5)
    assert rel_err(y, gemv.gemv(xn, wb, sb, bb, config=CUDA_CORE)) < 1e-2
    x_eager = silu_and_mul(x) if silu else x
    assert rel_err(y, gemv.gemv_ref(fused_add_rms_norm(
        gemv.gemv_ref(x_eager, wa, sa, ba), res, g, 1e-5)[0], wb, sb, bb)) < TOL[dtype]


@pytest.mark.parametrize("wdtype", ["same", "fp8"])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("k", [96, 80])  # even and ragged K tiles of the first GEMV
def test_gemv_add_residual_weighted_then_rms_scaled(wdtype, silu, k):
    """The epilogue form: gemv_add_residual_weighted -> gemv_rms_scaled == gemv ->
    fused_add_rms_norm -> gemv within bf16 rounding (one rounding of h * g instead of two),
    with the new residual bit for bit."""
    from kiln.runtime.kernels.activation import silu_and_mul
    from kiln.runtime.kernels.rms_norm import fused_add_rms_norm

    dtype = torch.bfloat16
    x, wa, sa, wb, sb, res, g, ba, bb = _residual_pair(wdtype, silu, k)
    h, hg, ss = gemv.gemv_add_residual_weighted(x, wa, sa, ba, res, g, silu_and_mul=silu,
                                                config=CUDA_CORE)
    assert ss.shape == (6,) and ss.dtype == torch.float32  # cdiv(44, BLOCK_N 8) tiles
    y = gemv.gemv_rms_scaled(hg, ss, 1e-5, wb, sb, bb, config=CUDA_CORE)
    a = gemv.gemv(x, wa, sa, ba, silu_and_mul=silu, config=CUDA_CORE)
    xn, h_ref = fused_add_rms_norm(a, res, g, 1e-5)
    assert torch.equal(h, h_ref)
    # h * g rounded once (within one bf16 step: the interpreter's casts truncate)
    assert torch.allclose(hg.float(), h_ref.float() * g.float(), rtol=2**-7, atol=0)
    assert torch.allclose(ss.sum(), h_ref.float().pow(2).sum(), rtol=1e-5)
    assert rel_err(y, gemv.gemv(xn, wb, sb, bb, config=CUDA_CORE)) < 1e-2
    x_eager = silu_and_mul(x) if silu else x
    assert rel_err(y, gemv.gemv_ref(fused_add_rms_norm(
        gemv.gemv_ref(x_eager, wa, sa, ba), res, g, 1e-5)[0], wb, sb, bb)) < TOL[dtype]
    # the statistics really come from ss: other partials, another scale
    y2 = gemv.gemv_rms_scaled(hg, ss * 4, 1e-5, wb, sb, None, config=CUDA_CORE)
    y1 = gemv.gemv_rms_scaled(hg, ss, 1e-5, wb, sb, None, config=CUDA_CORE)
    assert rel_err(y2 * 2, y1) < 1e-2


def test_gemv_add_residual_and_prenormed_errors():
    bf = torch.bfloat16
    x, r, g = torch.randn(1, 32, dtype=bf), torch.randn(1, 16, dtype=bf), torch.ones(16, dtype=bf)
    w, w2 = torch.randn(16, 32, dtype=bf), torch.randn(8, 16, dtype=bf)
    ss = torch.ones(2)
    for args, kw, msg in [
        ((torch.randn(2, 32, dtype=bf), w, None, None, r), {}, "x has 2 rows"),
        ((x, w, None, None, torch.randn(1, 15, dtype=bf)), {}, "residual has shape"),
        ((x, w, None, None, r), {"config": dict(CUDA_CORE, SPLIT_K=2)}, "without split-K"),
        ((x, w, None, None, r), {"config": TENSOR_CORE}, "without split-K"),
        ((torch.randn(1, 33, dtype=bf), w, None, None, r), {"silu_and_mul": True},
         "gate | up"),
    ]:
        with pytest.raises(ValueError, match=msg):
            gemv.gemv_add_residual(*args, **kw)
    for args, kw, msg in [
        ((r, ss.double(), g, 1e-5, w2), {}, "ss has dtype"),
        ((r, torch.ones(0), g, 1e-5, w2), {}, "0 partials"),
        ((r, ss, torch.ones(16), 1e-5, w2), {}, "norm_weight has dtype"),
        ((r, ss, g, 1e-5, w2), {"config": TENSOR_CORE}, "CUDA-core tiles only"),
    ]:
        with pytest.raises(ValueError, match=msg):
            gemv.gemv_prenormed(*args, **kw)
    for args, kw, msg in [
        ((r, ss.double(), 1e-5, w2), {}, "ss has dtype"),
        ((r, torch.ones(0), 1e-5, w2), {}, "0 partials"),
        ((torch.randn(2, 16, dtype=bf), ss, 1e-5, w2), {}, "hg has 2 rows"),
        ((r, ss, 1e-5, w2), {"config": TENSOR_CORE}, "CUDA-core tiles only"),
    ]:
        with pytest.raises(ValueError, match=msg):
            gemv.gemv_rms_scaled(*args, **kw)
    with pytest.raises(ValueError, match="norm_weight has shape"):
        gemv.gemv_add_residual_weighted(x, w, None, None, r, torch.ones(15, dtype=bf))


def test_residual_fusion_rule(monkeypatch):
    """One row, hidden at most RESIDUAL_FUSION_MAX_HIDDEN (smollm2's, not llama-3-8b's: the
    measured rule), both GEMVs on CUDA-core tiles, the first unsplit (its partials are the
    statistics)."""
    bf = torch.bfloat16
    for dt in (bf, FP8):
        assert gemv_configs.residual_fusion_applies(1, 576, 576, 3072, dt, dt)
        assert gemv_configs.residual_fusion_applies(1, 576, 1536, 960, dt, dt)
        assert not gemv_configs.residual_fusion_applies(2, 576, 576, 3072, dt, dt)
        # measured loss
        assert not gemv_configs.residual_fusion_applies(1, 4096, 4096, 28672, dt, dt)
    monkeypatch.setattr(gemv_configs, "RESIDUAL_FUSION_MAX_HIDDEN", 1 << 20)
    for dt in (bf, FP8):
        assert gemv_configs.residual_fusion_applies(1, 4096, 4096, 28672, dt, dt)
        assert gemv_configs.residual_fusion_applies(1, 4096, 14336, 6144, dt, dt)
    assert not gemv_configs.residual_fusion_applies(1, 256, 4096, 1024, bf, bf)  # split-K


def test_residual_fusion_form_rule():
    """smollm2's hidden size takes the prologue form, llama-3-8b's the epilogue form (its
    consumer keeps the plain loop's registers); one row only."""
    bf = torch.bfloat16
    for dt in (bf, FP8):
        assert gemv_configs.residual_fusion_form(1, 576, 576, 3072, dt, dt) == "prologue"
        assert gemv_configs.residual_fusion_form(1, 4096, 4096, 28672, dt, dt) == "epilogue"
        assert gemv_configs.residual_fusion_form(1, 4096, 14336, 6144, dt, dt) == "epilogue"
        assert gemv_configs.residual_fusion_form(2, 4096, 4096, 28672, dt, dt) is None


def test_norm_prologue_rule(monkeypatch):
    """On for one row at K <= NORM_PROLOGUE_MAX_K where gemv runs on CUDA-core tiles (the
    measured rule: smollm2's K 576 gained, llama-3-8b's K 4096 lost)."""
    assert gemv_configs.norm_prologue_applies(1, 960, 576, torch.bfloat16)  # smollm2 qkv
    assert gemv_configs.norm_prologue_applies(1, 3072, 576, FP8)  # smollm2 gate_up
    assert not gemv_configs.norm_prologue_applies(1, 6144, 4096, torch.bfloat16)  # over the max K
    assert not gemv_configs.norm_prologue_applies(2, 960, 576, torch.bfloat16)
    monkeypatch.setattr(gemv_configs, "NORM_PROLOGUE_MAX_K", 4096)
    assert gemv_configs.norm_prologue_applies(1, 6144, 4096, torch.bfloat16)
    assert gemv_configs.norm_prologue_applies(1, 28672, 4096, FP8)


def test_silu_fusion_rule():
    """SiLU-and-mul goes into the down GEMV up to SILU_FUSION_MAX_K, and for FP8 weights at
    one row whatever K (the measured rule under PDL)."""
    assert gemv_configs.silu_fusion_applies(1, 1536, False)
    assert gemv_configs.silu_fusion_applies(8, 1536, True)
    assert not gemv_configs.silu_fusion_applies(1, 14336, False)
    assert gemv_configs.silu_fusion_applies(1, 14336, True)
    assert not gemv_configs.silu_fusion_applies(2, 14336, True)
