"""The transformers baseline model made from an engine directory (kiln.bench.hf_baseline).

The model must be the engine's model: its tensors equal the original checkpoint's, and in
float32 its greedy tokens equal kiln's. The run helpers must fall back, and say so, when
compile or continuous batching fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.artifact.weights import random_weights
from kiln.bench.hf_baseline import (
    build_hf_model,
    hf_model_from_weights,
    run_hf_latency,
    run_hf_throughput,
)
from kiln.bench.offline import BenchRequest
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.models.calibration import ActivationCalibrator
from kiln.runtime.sampling_params import SamplingParams

PROMPTS = [[5, 17, 30, 9, 40, 3], [22, 11, 101], [7] * 12]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def kiln_greedy(engine_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu", num_kv_blocks=64))
    outs = eng.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_from_engine_is_the_checkpoint_and_greedy_equals_kiln(tiny_reference, arch):
    # llama: llama3 rope scaling, untied; qwen2: qkv bias; qwen3: tied, per-head q/k norm
    ref, engine_dir = tiny_reference(arch)
    model, info = build_hf_model(str(engine_dir), "cpu")
    assert type(model) is type(ref) and info["dequantized_fp8_linears"] == 0
    ours = model.state_dict()
    for name, t in ref.state_dict().items():
        assert torch.equal(ours[name], t), name
    for prompt, tokens in zip(PROMPTS, kiln_greedy(engine_dir, PROMPTS, 12)):
        assert hf_greedy(model, prompt, 12) == tokens


def test_random_engine_greedy_equals_kiln(tmp_path):
    from kiln.builder import build_engine

    out = tmp_path / "e"
    build_engine("random:tiny-llama", out, dtype="float32", progress=False)
    model, _ = build_hf_model(str(out), "cpu")
    for prompt, tokens in zip(PROMPTS, kiln_greedy(out, PROMPTS, 12)):
        assert hf_greedy(model, prompt, 12) == tokens


def test_fp8_engine_is_dequantized_to_the_compute_dtype(tmp_path, capsys):
    from kiln.artifact.loader import load_engine
    from kiln.artifact.spec import QuantConfig
    from kiln.builder import build_engine

    out = tmp_path / "e"
    spec = build_engine("random:tiny-llama", out, dtype="float32", progress=False,
                        quantization=QuantConfig("fp8", "fp8", "fp8"))
    model, info = build_hf_model(str(out), "cpu")
    assert info["dequantized_fp8_linears"] == 4 * spec.model.num_layers
    assert "dequantized" in info["weights"] and "float32" in info["weights"]
    w = load_engine(out).load_weights(calibrator=ActivationCalibrator)
    q_size, inter = spec.model.q_size, spec.model.intermediate_size
    dense = w["layers.1.qkv.weight"].float() * w["layers.1.qkv.weight_scale"]
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight.dtype == torch.float32
    assert torch.equal(attn.q_proj.weight, dense[:q_size])
    up = (w["layers.0.gate_up.weight"].float() * w["layers.0.gate_up.weight_scale"])[inter:]
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, up)


def test_mistral_and_llama_with_qkv_bias_map_to_transformers():
    from kiln.sources.random import PRESETS

    base = PRESETS["tiny-llama"]
    w = random_weights(base, 3, dtype=torch.float32, std=0.2)
    llama, _ = hf_model_from_weights(base, dict(w), torch.float32, "cpu")
    mistral_cfg = dataclasses.replace(base, architecture="mistral", sliding_window=4096)
    mistral, _ = hf_model_from_weights(mistral_cfg, dict(w), torch.float32, "cpu")
    assert type(mistral).__name__ == "MistralForCausalLM"
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(llama(ids).logits, mistral(ids).logits)

    biased = dataclasses.replace(base, qkv_bias=True)
    wb = random_weights(biased, 4, dtype=torch.float32, std=0.2)
    bias = wb["layers.0.qkv.bias"].clone()
    model, _ = hf_model_from_weights(biased, wb, torch.float32, "cpu")
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.k_proj.bias, bias[biased.q_size:biased.q_size + biased.kv_size])
    assert not attn.o_proj.bias.any()  # transformers' attention_bias adds one kiln lacks


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kiln.builder import build_engine

    out = tmp_path_factory.mktemp("hf") / "e"
    build_engine("random:tiny-llama", out, dtype="float32", progress=False)
    return build_hf_model(str(out), "cpu")[0]


def test_compile_failure_falls_back_to_static_eager(tiny_model, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(tiny_model, "get_compiled_call", broken)
    r = run_hf_latency(tiny_model, [], [PROMPTS[:1]] * 2, 5, compile_=True)
    assert r["mode"].startswith("static-cache (eager) (compile failed: RuntimeError")
    assert "inductor exploded" in r["fallbacks"][0]
    assert r["output_tokens"] == 10 and [it["output_tokens"] for it in r["iterations"]] == [5, 5]


def test_generate_batch_failure_falls_back_to_padded_batches(tiny_model, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no paged attention here")

    monkeypatch.setattr(tiny_model, "generate_batch", broken)
    reqs = [BenchRequest(p, n) for p, n in zip(PROMPTS, (3, 5, 4))]
    r = run_hf_throughput(tiny_model, reqs, fallback_batch_size=2)
    assert r["mode"].startswith("padded-batches")
    assert "no paged attention here" in r["fallbacks"][0]
    assert r["output_tokens"] == r["expected_output_tokens"] == 12


def test_per_request_output_lengths_run_in_continuous_batching(tiny_model):
    reqs = [BenchRequest(p, n) for p, n in zip(PROMPTS, (3, 5, 4))]
    r = run_hf_throughput(tiny_model, reqs)
    assert r["fallbacks"] == [] and "continuous_batching" in r["mode"]
    assert r["output_tokens"] == 12 and r["tokens_per_s"] > 0
