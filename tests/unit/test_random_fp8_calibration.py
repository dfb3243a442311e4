"""Random FP8 engines (`kiln build random:<preset> --quantization fp8`) run the activation
scheme of a `kiln quantize` checkpoint: static per-tensor input scales, calibrated at load on
seeded random-token sequences (kiln/runtime/models/calibration.py), recorded in engine.json.
The oracle for the scales is transformers' model of the same unquantized weights."""

from __future__ import annotations

import pytest
import torch

from kiln.artifact.loader import load_engine
from kiln.artifact.spec import QuantConfig
from kiln.artifact.weights import LINEARS, RandomCalibration, random_weights
from kiln.builder import build_engine
from kiln.runtime.models.calibration import ActivationCalibrator

FP8_STATIC = QuantConfig("fp8", "fp8")


def hf_input_amax(cfg, seed: int, calibration: RandomCalibration) -> dict[str, float]:
    """max |input| of each fused projection (its first HF module's input) over the
    calibration tokens, through transformers' model of the unquantized random weights."""
    from kiln.bench.hf_baseline import hf_model_from_weights

    model, _ = hf_model_from_weights(cfg, random_weights(cfg, seed, dtype=torch.float32),
                                     torch.float32, "cpu")
    first = {"qkv": "self_attn.q_proj", "o_proj": "self_attn.o_proj",
             "gate_up": "mlp.gate_proj", "down": "mlp.down_proj"}
    amax: dict[str, float] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for lin, path in first.items():
            def hook(_, args, name=f"layers.{i}.{lin}"):
                amax[name] = float(args[0].abs().amax())
            hooks.append(layer.get_submodule(path).register_forward_pre_hook(hook))
    with torch.no_grad():
        model(calibration.tokens(cfg.vocab_size))  # [num_seqs, seq_len]: causal per sequence
    for h in hooks:
        h.remove()
    return amax


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_random_fp8_engine_calibrates_static_input_scales(tmp_path, preset):
    """engine.json says static with the calibration's provenance; every FP8 linear of the
    loaded weights has input_scale = its input's amax / 448 over the calibration tokens, as
    transformers' forward of the unquantized weights sees them (qkv_bias, q/k norms too)."""
    seed = 5
    spec = build_engine(f"random:{preset}:{seed}", tmp_path / "e", dtype="float32",
                        progress=False, quantization=FP8_STATIC)
    scales = spec.quantization.scales
    assert scales["activations"] == "static"
    cal = scales["calibration"]
    assert (cal["calib_size"], cal["calib_seq_len"], cal["seed"]) == (4, 256, seed)
    assert "calibrated at load on 4 random-token sequences" in cal["description"]
    w = load_engine(tmp_path / "e").load_weights(calibrator=ActivationCalibrator)
    amax = hf_input_amax(spec.model, seed, RandomCalibration(seed=seed))
    assert len(amax) == len(LINEARS) * spec.model.num_layers
    for name, a in amax.items():
        s = w[name + ".input_scale"]
        assert s.dtype == torch.float32 and s.shape == ()
        assert float(s) == pytest.approx(a / 448, rel=1e-4), name


def test_calibration_depends_on_the_seed_only(tmp_path):
    """The same seed gives the same scales (loaded twice, tensor-parallel shards included);
    another seed other weights, other tokens, other scales."""
    for name, src, tp in (("a", "random:tiny-llama:1", 1), ("b", "random:tiny-llama:1", 2),
                          ("c", "random:tiny-llama:2", 1)):
        build_engine(src, tmp_path / name, dtype="float32", progress=False,
                     quantization=FP8_STATIC, tp=tp)
    a = load_engine(tmp_path / "a").load_weights(calibrator=ActivationCalibrator)
    again = load_engine(tmp_path / "a").load_weights(calibrator=ActivationCalibrator)
    rank1 = load_engine(tmp_path / "b").load_weights(rank=1, calibrator=ActivationCalibrator)
    c = load_engine(tmp_path / "c").load_weights(calibrator=ActivationCalibrator)
    names = [n for n in a if n.endswith(".input_scale")]
    assert len(names) == 8
    for n in names:
        assert torch.equal(a[n], again[n]) and torch.equal(a[n], rank1[n])
    assert all(not torch.equal(a[n], c[n]) for n in names)


def test_random_fp8_engine_generates_with_static_scales(tmp_path):
    """Every FP8 linear of the running model has an input scale (the per-tensor static
    path), and greedy decoding produces tokens."""
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    build_engine("random:tiny-llama", tmp_path / "e", dtype="float32", progress=False,
                 quantization=FP8_STATIC)
    engine = LLMEngine.from_engine_dir(tmp_path / "e",
                                       RuntimeConfig(device="cpu", num_kv_blocks=64))
    fp8 = {p: lin for p, lin in engine.model.linears.items() if lin.fp8}
    assert len(fp8) == 4 * engine.model.cfg.num_layers
    assert all(lin.input_scale is not None for lin in fp8.values())
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0,
                                                       ignore_eos=True))
    assert len(out[0].token_ids) == 6


def test_dynamic_activations_on_request(tmp_path):
    """scales={"activations": "dynamic"} keeps a random engine's activations dynamic: no
    calibration, no input scales (as random engines built before calibration load)."""
    q = QuantConfig("fp8", "fp8", scales={"activations": "dynamic"})
    spec = build_engine("random:tiny-llama", tmp_path / "e", dtype="float32", progress=False,
                        quantization=q)
    assert spec.quantization.scales["activations"] == "dynamic"
    assert "calibration" not in spec.quantization.scales
    w = load_engine(tmp_path / "e").load_weights()  # nothing to calibrate
    assert w["layers.0.qkv.weight"].dtype == torch.float8_e4m3fn
    assert not [n for n in w if n.endswith(".input_scale")]
    with pytest.raises(ValueError, match="'static'.*'dynamic'"):
        build_engine("random:tiny-llama", tmp_path / "x", progress=False,
                     quantization=QuantConfig("fp8", "fp8", scales={"activations": "per-row"}))


def test_static_scales_need_the_models_calibrator(tmp_path):
    """The artifact makes the weights, the runtime's model calibrates them: loading a static
    random FP8 engine without a calibrator is one clear error naming it."""
    build_engine("random:tiny-llama", tmp_path / "e", dtype="float32", progress=False,
                 quantization=FP8_STATIC)
    with pytest.raises(ValueError, match="random FP8 engine.*ActivationCalibrator"):
        load_engine(tmp_path / "e").load_weights()
