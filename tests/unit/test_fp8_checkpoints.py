"""FP8 checkpoints in `kiln build`: compressed-tensors (written here), KV scale handling."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import write_compressed_tensors
from safetensors.torch import load_file, save_file

from kiln.artifact.loader import load_engine
from kiln.builder import build_engine
from kiln.errors import SourceError
from kiln.eval.perplexity import perplexity
from kiln.quantize.calib import load_text_set
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.layers.linear import FP8
from kiln.runtime.sampling_params import SamplingParams


def _assert_near_the_unquantized_model(src, tmp_path):
    """The FP8 engine at tmp_path/e stays within 2 % of the float32 engine of ``src`` in
    perplexity (over 1,000 tokens of the built-in eval set)."""
    build_engine(str(src), tmp_path / "ref", dtype="float32", max_seq_len=256, progress=False)
    text = tmp_path / "text.txt"
    text.write_text(load_text_set(None, "eval").documents[1][:1500])
    ref = perplexity(tmp_path / "ref", data=text, seq_len=128, progress=False)
    got = perplexity(tmp_path / "e", data=text, seq_len=128, progress=False)
    assert got["tokens"] == ref["tokens"] > 1000
    assert abs(math.log(got["perplexity"] / ref["perplexity"])) < 0.02


@pytest.mark.parametrize("dynamic,kv", [(False, True), (True, False)])
def test_compressed_tensors_fp8_builds_and_runs(tiny_hf_model, tmp_path, capsys, dynamic, kv):
    src = tiny_hf_model("llama")
    ckpt = write_compressed_tensors(src, tmp_path / "ct", dynamic=dynamic, kv=kv)
    spec = build_engine(str(ckpt), tmp_path / "e", dtype="float32", max_seq_len=256,
                        progress=False)
    q = spec.quantization
    assert (q.weights, q.activations) == ("fp8", "fp8")
    assert q.kv_cache == ("fp8" if kv else "float32")
    assert q.scales["source"] == "compressed-tensors"
    assert q.scales["activations"] == ("dynamic" if dynamic else "static")
    if kv:
        assert q.scales["kv_cache"] == "checkpoint (calibrated)"
        assert "WARNING" not in capsys.readouterr().err
    w = load_engine(tmp_path / "e").load_weights()
    assert w["layers.0.qkv.weight"].dtype == FP8 and w["layers.0.down.weight"].dtype == FP8
    assert ("layers.0.qkv.input_scale" in w) == (not dynamic)
    assert w["embed_tokens.weight"].dtype == torch.float32

    engine = LLMEngine.from_engine_dir(tmp_path / "e", RuntimeConfig(device="cpu"))
    if kv:
        assert engine.cache.k.dtype == FP8
        torch.testing.assert_close(engine.cache.k_scale, torch.tensor([0.02, 0.03]))
    out = engine.generate([[256, 72, 105]], SamplingParams(max_tokens=6, temperature=0,
                                                            ignore_eos=True))
    assert len(out[0].token_ids) == 6

    _assert_near_the_unquantized_model(src, tmp_path)


@pytest.mark.parametrize("dynamic", [True, False], ids=["fp8-dynamic", "static"])
def test_per_channel_checkpoint_builds_its_row_scales_exactly(tiny_hf_model, tmp_path, dynamic):
    """llm-compressor's FP8_DYNAMIC (per-channel weights, per-token activations): the engine
    keeps every e4m3 byte and each output row's scale, fused q/k/v and gate/up as their
    shards concatenated, so the engine's dequantized weight equals the checkpoint's exactly;
    the model stays within 2 % of the unquantized one's perplexity."""
    src = tiny_hf_model("qwen2")
    ckpt = write_compressed_tensors(src, tmp_path / "ct", dynamic=dynamic, kv=False,
                                    strategy="channel")
    spec = build_engine(str(ckpt), tmp_path / "e", dtype="float32", max_seq_len=256,
                        progress=False)
    assert spec.quantization.scales["weights"].startswith("per-channel")
    assert spec.quantization.scales["activations"] == ("dynamic" if dynamic else "static")
    w = load_engine(tmp_path / "e").load_weights()
    c = load_file(str(ckpt / "model.safetensors"))
    for i in range(2):
        for fused, parts in (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
                             ("o_proj", ("self_attn.o_proj",)), ("down", ("mlp.down_proj",))):
            want = torch.cat([c[f"model.layers.{i}.{m}.weight"].float()
                              * c[f"model.layers.{i}.{m}.weight_scale"] for m in parts])
            got_w, got_s = w[f"layers.{i}.{fused}.weight"], w[f"layers.{i}.{fused}.weight_scale"]
            assert got_w.dtype == FP8 and got_s.shape == (want.shape[0],), fused
            assert torch.equal(got_w.float() * got_s[:, None], want), (i, fused)
    engine = LLMEngine.from_engine_dir(tmp_path / "e", RuntimeConfig(device="cpu"))
    qkv = engine.runner.model.linears["layers.0.qkv"]
    assert qkv.activation_scheme == ("per-token" if dynamic else "static")
    _assert_near_the_unquantized_model(src, tmp_path)


def test_kv_fp8_without_scales_warns(tiny_hf_model, tmp_path, capsys):
    from kiln.artifact.spec import QuantConfig

    spec = build_engine(str(tiny_hf_model("llama")), tmp_path / "e", dtype="float32",
                        quantization=QuantConfig(kv_cache="fp8"), progress=False)
    err = capsys.readouterr().err
    assert "WARNING" in err and "no k_scale/v_scale" in err
    assert spec.quantization.weights == "none" and spec.quantization.kv_cache == "fp8"
    assert spec.quantization.scales["kv_cache"].startswith("1.0 (missing")
    engine = LLMEngine.from_engine_dir(tmp_path / "e", RuntimeConfig(device="cpu"))
    assert engine.cache.k.dtype == FP8 and float(engine.cache.k_scale.min()) == 1.0
    assert engine.cache.k.dtype == FP8
    out = engine.generate([[256, 72]], SamplingParams(max_tokens=3, temperature=0,
                                                      ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_kv_scales_all_one_warns(tiny_hf_model, tmp_path, capsys):
    ckpt = write_compressed_tensors(tiny_hf_model("llama"), tmp_path / "ct", dynamic=True,
                                    kv=True)
    tensors = load_file(str(ckpt / "model.safetensors"))
    for k in tensors:
        if k.endswith(("k_scale", "v_scale")):
            tensors[k] = torch.tensor(1.0)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    spec = build_engine(str(ckpt), tmp_path / "e", progress=False)
    assert "exactly 1.0" in capsys.readouterr().err
    assert spec.quantization.scales["kv_cache"] == "checkpoint (all exactly 1.0)"


def test_unsupported_quantization_is_refused(tiny_hf_model, tmp_path):
    ckpt = write_compressed_tensors(tiny_hf_model("llama"), tmp_path / "ct", dynamic=True,
                                    kv=False)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="strategy 'tensor' or 'channel'"):
        build_engine(str(ckpt), tmp_path / "e", progress=False)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="gptq"):
        build_engine(str(ckpt), tmp_path / "e", progress=False)


def test_fp8_weights_need_a_checkpoint(tiny_hf_model, tmp_path):
    from kiln.artifact.spec import QuantConfig
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match="kiln quantize"):
        build_engine(str(tiny_hf_model("llama")), tmp_path / "e", progress=False,
                     quantization=QuantConfig("fp8", "fp8"))
