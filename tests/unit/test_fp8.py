"""FP8 building blocks: fused-scale requantization, FP8 linear, FP8 KV cache, mixed-dtype
safetensors, random FP8 engines."""

from __future__ import annotations

import torch
from safetensors import safe_open

from kiln.artifact.weights import quantize_per_tensor
from kiln.builder.fp8 import requantize_fused
from kiln.builder.safetensors_stream import SafetensorsStreamWriter
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import read_kv, write_kv
from kiln.runtime.layers.linear import FP8, Linear, fp8_linear, place_weights
from kiln.runtime.models.calibration import ActivationCalibrator

E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa, relative


def test_requantize_fused_exact_against_reference():
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(48, 32, generator=g) * a for a in (0.7, 3.0, 1.1)]
    parts = [quantize_per_tensor(w) for w in shards]
    fused, scale = requantize_fused(parts)

    # reference: dequantize every shard in float64, quantize with the largest shard scale
    s_max = max(float(s) for _, s in parts)
    ref = torch.cat([(q.double() * float(s) / s_max).to(FP8) for q, s in parts])
    assert float(scale) == s_max
    assert fused.dtype == FP8 and fused.shape == (144, 32)
    assert torch.equal(fused.view(torch.uint8), ref.view(torch.uint8))
    # the shard that owns the max scale is copied bit for bit
    assert torch.equal(fused[48:96].view(torch.uint8), parts[1][0].view(torch.uint8))
    # and the fused tensor still represents the original weights
    deq = fused.float() * scale
    orig = torch.cat(shards)
    assert (deq - orig).abs().max() <= orig.abs().max() * E4M3_REL * 2


def test_quantize_per_tensor_scale_and_error():
    w = torch.randn(64, 64)
    q, s = quantize_per_tensor(w)
    assert torch.isclose(s, w.abs().max() / 448)
    assert q.float().abs().max() == 448  # the amax element maps to the top of the range
    rel = ((q.float() * s - w).abs() / w.abs().clamp(min=s * 64)).max()
    assert rel <= E4M3_REL


def test_fp8_linear_cpu_matches_dequantized_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 64, generator=g)
    w = torch.randn(32, 64, generator=g) * 0.05
    bias = torch.randn(32, generator=g)
    q, s = quantize_per_tensor(w)
    for input_scale in (None, x.abs().max() / 448):
        y = fp8_linear(x, q, s, input_scale, bias)
        assert y.shape == (5, 3, 32) and y.dtype == x.dtype
        # dynamic: one scale per token (row), each row's amax * fp32(1 / 448)
        x_scale = (x.abs().amax(-1, keepdim=True) * (1 / 448) if input_scale is None
                   else input_scale)
        xd = (x / x_scale).to(FP8).float() * x_scale
        ref = xd @ (q.float() * s).T + bias
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        # vs the unquantized layer: FP8 error only
        exact = x @ w.T + bias
        assert (y - exact).abs().max() < 0.05 * exact.abs().max()


def test_linear_dispatch_and_place_weights():
    w = torch.randn(16, 32)
    q, s = quantize_per_tensor(w)
    weights = place_weights({"a.weight": w, "b.weight": q, "b.weight_scale": s}, "cpu",
                            torch.bfloat16)
    assert weights["a.weight"].dtype == torch.bfloat16
    assert weights["b.weight"].dtype == FP8 and weights["b.weight_scale"].dtype == torch.float32
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert Linear.from_weights(weights, "a")(x).dtype == torch.bfloat16
    y = Linear.from_weights(weights, "b")(x)
    assert y.dtype == torch.bfloat16
    ref = x.float() @ w.T
    assert (y.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_fp8_kv_cache_store_load_error_bounded():
    layers, heads, dim = 2, 2, 16
    g = torch.Generator().manual_seed(2)
    k = torch.randn(10, heads, dim, generator=g) * 3
    v = torch.randn(10, heads, dim, generator=g) * 0.2
    k_scale = torch.tensor([k.abs().max() / 448, 1.0])
    v_scale = torch.tensor([v.abs().max() / 448, 1.0])
    cache = KVCache(layers, 4, 4, heads, dim, FP8, "cpu", k_scale, v_scale)
    assert cache.is_fp8 and cache.k.dtype == FP8
    slots = torch.tensor([3, 0, 7, 12, 5, 9, 1, 15, 2, 4])
    write_kv(0, k, v, cache, slots)
    ks, vs = read_kv(0, cache, slots, torch.float32)
    for got, want, scale in ((ks, k, k_scale[0]), (vs, v, v_scale[0])):
        err = (got - want).abs()
        # relative error of e4m3 for normal values, absolute floor for subnormal ones
        assert (err <= want.abs() * E4M3_REL + scale * 2.0**-9).all()
    # slots never written stay zero; the other layer is untouched
    assert read_kv(0, cache, torch.tensor([6]), torch.float32)[0].abs().sum() == 0
    assert cache.k[1].float().abs().sum() == 0


def test_kv_cache_scales_must_match_layers():
    import pytest

    with pytest.raises(ValueError, match="one per layer"):
        KVCache(3, 2, 4, 1, 8, FP8, "cpu", torch.ones(2), torch.ones(2))


def test_stream_writer_mixed_dtypes(tmp_path):
    q, s = quantize_per_tensor(torch.randn(8, 16))
    norm = torch.ones(16, dtype=torch.bfloat16)
    shapes = {"w": (8, 16), "w_scale": (), "norm": (16,)}
    path = tmp_path / "m.safetensors"
    writer = SafetensorsStreamWriter(path, shapes, torch.bfloat16,
                                     dtypes={"w": FP8, "w_scale": torch.float32})
    writer.write("w", q)
    writer.write("w_scale", s)
    writer.write("norm", norm)
    writer.close()
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("w").view(torch.uint8), q.view(torch.uint8))
        assert f.get_tensor("w_scale").shape == () and float(f.get_tensor("w_scale")) == float(s)
        assert f.get_tensor("norm").dtype == torch.bfloat16


def test_random_fp8_engine_runs(tmp_path, capsys):
    from kiln.artifact.loader import load_engine
    from kiln.artifact.spec import QuantConfig
    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    out = tmp_path / "e"
    spec = build_engine("random:tiny-llama", out, dtype="float32", progress=False,
                        quantization=QuantConfig("fp8", "fp8", "fp8"))
    assert "WARNING" in capsys.readouterr().err  # KV scales are 1.0
    assert spec.quantization.weights == "fp8" and spec.quantization.kv_cache == "fp8"
    assert spec.quantization.scales["source"] == "random"
    w = load_engine(out).load_weights(calibrator=ActivationCalibrator)
    assert w["layers.0.qkv.weight"].dtype == FP8 and "layers.1.v_scale" in w
    engine = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", num_kv_blocks=64))
    assert engine.cache.k.dtype == FP8
    # loading it says so too: every serve, generate and bench of it
    err = capsys.readouterr().err
    assert "warning: this engine's FP8 KV cache runs with uncalibrated scales" in err, err
    assert "1.0 (missing in the source" in err and "--kv-cache-dtype fp8" in err, err
    outs = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0,
                                                        ignore_eos=True))
    assert len(outs[0].token_ids) == 4


def test_random_per_channel_fp8_engine_has_row_scales_and_per_token_activations(tmp_path):
    """`kiln build random:X --quantization fp8_pc_pt`: the scheme of `kiln quantize --qformat
    fp8_pc_pt` on random weights (for benchmarks): each linear's scale is its rows' amax / 448
    of the unquantized random weight, no input_scale, activations per token."""
    import pytest

    from kiln.artifact.loader import load_engine
    from kiln.builder import build_engine
    from kiln.cli.build import _quant_config
    from kiln.errors import KilnError
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    q = _quant_config("fp8_pc_pt", "fp8", False)
    spec = build_engine("random:tiny-llama", tmp_path / "e", dtype="float32", progress=False,
                        quantization=q)
    assert spec.quantization.scales["weights"].startswith("per-channel")
    assert spec.quantization.scales["activations"] == "dynamic"
    build_engine("random:tiny-llama", tmp_path / "ref", dtype="float32", progress=False)
    ref = load_engine(tmp_path / "ref").load_weights()
    w = load_engine(tmp_path / "e").load_weights()
    for lin in ("qkv", "o_proj", "gate_up", "down"):
        name = f"layers.1.{lin}"
        want = ref[name + ".weight"].abs().amax(dim=1) / 448
        assert w[name + ".weight"].dtype == FP8 and name + ".input_scale" not in w
        torch.testing.assert_close(w[name + ".weight_scale"], want, rtol=1e-6, atol=0)
    engine = LLMEngine.from_engine_dir(tmp_path / "e", RuntimeConfig(device="cpu",
                                                                      num_kv_blocks=64))
    assert {lin.activation_scheme for lin in engine.runner.model.linears.values()
            if lin.fp8} == {"per-token"}
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0,
                                                       ignore_eos=True))
    assert len(out[0].token_ids) == 4
    with pytest.raises(KilnError, match=r"--quantization 'int4' is not supported; use one of "
                       r"\['none', 'fp8', 'fp8_pc_pt'\]"):
        _quant_config("int4", "auto", False)


def test_no_kv_scale_warning_for_calibrated_or_unquantized_kv():
    from kiln.artifact.spec import QuantConfig

    calibrated = QuantConfig("fp8", "fp8", "fp8", {"kv_cache": "checkpoint (calibrated)"})
    assert calibrated.kv_scale_warning() is None
    assert QuantConfig("fp8", "fp8", "bfloat16").kv_scale_warning() is None
    assert QuantConfig().kv_scale_warning() is None
    ones = QuantConfig("fp8", "fp8", "fp8", {"kv_cache": "checkpoint (all exactly 1.0)"})
    assert "(engine.json: checkpoint (all exactly 1.0))" in ones.kv_scale_warning()
