"""`kiln build --quantize-lm-head`: the FP8 output projection (engine.json quantization.lm_head).

The engine's lm_head must be e4m3 + one float32 scale per row, exactly quantize_per_row of the
engine-dtype head (tied models: of the embedding, which stays), for every source; the runtime
must run that tensor: its logits and greedy tokens equal a transformers reference whose head
is the FP8 one (an FP8 linear without an input scale also quantizes its activations,
dynamically, per token, so the reference does too).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import hf_greedy, mixed_prompts, write_compressed_tensors
from safetensors import safe_open
from typer.testing import CliRunner

from kiln.artifact.loader import load_engine
from kiln.artifact.spec import QuantConfig
from kiln.artifact.weights import FP8, FP8_MAX, quantize_per_row
from kiln.bench.hf_baseline import build_hf_model
from kiln.builder import build_engine
from kiln.errors import EngineFormatError
from kiln.eval.perplexity import window_nll
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.layers.attention import AttentionMetadata, SeqAttention
from kiln.runtime.models.calibration import ActivationCalibrator
from kiln.runtime.sampling_params import SamplingParams

FP8_HEAD = QuantConfig(lm_head="fp8")
ENGINE_OPTS = {"max_seq_len": 128, "max_num_tokens": 64, "max_batch_size": 8}


def _source(kind: str, tiny_hf_model, tmp_path) -> str:
    """random:<preset> as is; hf-<arch>: the tiny float32 checkpoint; ct-<arch>: it as a
    compressed-tensors FP8 checkpoint (lm_head left unquantized, like llm-compressor)."""
    if kind.startswith("random:"):
        return kind
    fmt, arch = kind.split("-")
    src = tiny_hf_model(arch)
    if fmt == "ct":
        src = write_compressed_tensors(src, tmp_path / "ct", dynamic=True, kv=False)
    return str(src)


def _head(weights: dict[str, torch.Tensor], tied: bool) -> torch.Tensor:
    """The output projection an engine without the flag runs."""
    return weights["embed_tokens.weight" if tied else "lm_head.weight"]


@pytest.mark.parametrize("kind, quant", [
    ("random:tiny-llama", "none"), ("random:tiny-qwen2", "none"),  # untied, tied
    ("random:tiny-qwen2", "fp8"),  # with random FP8 linears
    ("hf-llama", "none"), ("hf-qwen3", "none"),  # untied, tied checkpoints
    ("ct-llama", "none"),  # a compressed-tensors FP8 checkpoint
])
def test_build_writes_the_fp8_head_of_the_engine_dtype_head(kind, quant, tiny_hf_model,
                                                           tmp_path):
    src = _source(kind, tiny_hf_model, tmp_path)
    fp8_head = QuantConfig(quant, quant, lm_head="fp8")
    spec = build_engine(src, tmp_path / "e", quantization=fp8_head, progress=False)
    build_engine(src, tmp_path / "ref", quantization=QuantConfig(quant, quant), progress=False)
    assert spec.quantization.lm_head == "fp8" and spec.dtype == "bfloat16"
    saved = json.loads((tmp_path / "e" / "engine.json").read_text())
    assert saved["quantization"]["lm_head"] == "fp8"
    cfg = spec.model
    if not spec.is_random:  # the file itself: e4m3 head, float32 scale, nothing else added
        with safe_open(str(tmp_path / "e" / "weights.safetensors"), "pt") as f:
            head, scale = f.get_tensor("lm_head.weight"), f.get_tensor("lm_head.weight_scale")
            assert (head.dtype, scale.dtype, tuple(scale.shape)) == (FP8, torch.float32,
                                                                     (cfg.vocab_size,))
            names = set(f.keys())
        with safe_open(str(tmp_path / "ref" / "weights.safetensors"), "pt") as f:
            added = names - set(f.keys())
        assert added == ({"lm_head.weight", "lm_head.weight_scale"} if cfg.tie_word_embeddings
                         else {"lm_head.weight_scale"})
    w = load_engine(tmp_path / "e").load_weights(calibrator=ActivationCalibrator)
    ref = load_engine(tmp_path / "ref").load_weights(calibrator=ActivationCalibrator)
    assert w["lm_head.weight"].dtype == FP8 and w["lm_head.weight_scale"].dtype == torch.float32
    assert tuple(w["lm_head.weight"].shape) == (cfg.vocab_size, cfg.hidden_size)
    assert torch.equal(w["embed_tokens.weight"], ref["embed_tokens.weight"])  # stays bf16
    assert (w["layers.0.qkv.weight"].dtype == FP8) == (kind.startswith("ct") or quant == "fp8")
    original = _head(ref, cfg.tie_word_embeddings)
    q, s = quantize_per_row(original)
    assert torch.equal(w["lm_head.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(w["lm_head.weight_scale"], s)
    # e4m3 rounding: 2^-4 of each value, or half the subnormal step 2^-9 * s near zero
    s = s[:, None]
    err = (w["lm_head.weight"].float() * s - original.float()).abs()
    assert bool((err <= torch.maximum(original.float().abs() / 16, s * 2.0**-10)).all())
    amax = original.float().abs().amax(dim=1, keepdim=True)  # each row's amax is 448 * s
    assert torch.allclose(amax, s * FP8_MAX, rtol=1e-6)


def _logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Float32 logits [len(ids), V] of one prefill through the engine's model (every row)."""
    n = len(ids)
    slots = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=slots, seqs=[
        SeqAttention(query_start=0, query_len=n, context_len=n, key_slots=slots)])
    return engine.model.forward(torch.tensor(ids), slots, engine.cache, meta, slots)


class Fp8Head(torch.nn.Module):
    """A transformers lm_head that is the FP8 head as kiln's CPU FP8 linear runs it: the
    activations quantized per token (each row's amax * fp32(1 / 448)), both dequantized,
    float32 matmul."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.weight = weight.float() * scale[:, None]  # [V, H], one scale per row

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        xs = (h.abs().amax(-1, keepdim=True).float() * (1 / FP8_MAX)).clamp(min=1e-12)
        x = (h.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * xs
        return x @ self.weight.T


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied, tied
def test_runtime_runs_the_fp8_head(tiny_reference, arch):
    """float32 engines (FP8 weights in a float32 engine are allowed, as for --quantization
    fp8): logits and greedy tokens equal transformers with the FP8 head, not the original."""
    model, plain_dir = tiny_reference(arch)
    _, fp8_dir = tiny_reference(arch, quantization=FP8_HEAD)
    w = load_engine(fp8_dir).load_weights()
    ref = copy.deepcopy(model)
    ref.lm_head = Fp8Head(w["lm_head.weight"], w["lm_head.weight_scale"])
    fp8 = LLMEngine.from_engine_dir(fp8_dir, RuntimeConfig(device="cpu"))
    plain = LLMEngine.from_engine_dir(plain_dir, RuntimeConfig(device="cpu"))
    assert fp8.model.lm_head == "lm_head"
    ids = mixed_prompts()[4]  # 40 tokens
    with torch.no_grad():
        want, orig = ref(torch.tensor([ids])).logits[0], model(torch.tensor([ids])).logits[0]
    got, base = _logits(fp8, ids), _logits(plain, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base, orig, rtol=1e-4, atol=1e-4)
    assert float((got - base).abs().max()) > 1e-2  # the flag changes the logits
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for prompt in mixed_prompts()[:4]:
        assert fp8.generate([prompt], greedy)[0].token_ids == hf_greedy(ref, prompt, 12)


def test_fp8_head_costs_little_perplexity(tiny_reference):
    """The FP8 head's log-likelihood stays close to the original's on the tiny model."""
    _, plain_dir = tiny_reference("qwen3")
    _, fp8_dir = tiny_reference("qwen3", quantization=FP8_HEAD)
    ids = mixed_prompts()[4]
    engines = [LLMEngine.from_engine_dir(d, RuntimeConfig(device="cpu"))
               for d in (plain_dir, fp8_dir)]
    base, got = (window_nll(e, ids) for e in engines)
    assert got != base and abs(got - base) / base < 0.02


def test_engine_json_without_the_key_loads_as_none(tiny_hf_model, tmp_path):
    build_engine(str(tiny_hf_model("llama")), tmp_path / "e", progress=False)
    path = tmp_path / "e" / "engine.json"
    raw = json.loads(path.read_text())
    # engines without an FP8 lm_head are written without the key (older kiln reads them)
    assert "lm_head" not in raw["quantization"]
    art = load_engine(tmp_path / "e")
    assert art.spec.quantization.lm_head == "none"
    assert art.load_weights()["lm_head.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"lm_head 'int4' is not supported; use one of"):
        QuantConfig(lm_head="int4")


def test_format_version_is_the_oldest_that_holds_the_engine(tmp_path, monkeypatch):
    """Format 2 only for an FP8 lm_head; every other engine stays 1, readable by older kiln
    (which says "upgrade kiln" for a 2)."""
    from kiln.artifact import loader

    build_engine("random:tiny-llama", tmp_path / "plain", progress=False)
    build_engine("random:tiny-llama", tmp_path / "head", quantization=FP8_HEAD, progress=False)
    assert load_engine(tmp_path / "plain").spec.format_version == 1
    assert load_engine(tmp_path / "head").spec.format_version == 2
    monkeypatch.setattr(loader, "ENGINE_FORMAT_VERSION", 1)  # a kiln from before the option
    load_engine(tmp_path / "plain")
    with pytest.raises(EngineFormatError, match=r"format 2.*reads up to format 1.*upgrade kiln"):
        load_engine(tmp_path / "head")


def _set_lm_head(engine_dir, value: str) -> None:
    path = engine_dir / "engine.json"
    raw = json.loads(path.read_text())
    raw["quantization"]["lm_head"] = value
    path.write_text(json.dumps(raw))


def test_engine_json_and_weights_must_agree(tiny_hf_model, tmp_path):
    """engine.json's lm_head and the file's tensors must agree, both ways (tied model)."""
    src = str(tiny_hf_model("qwen3"))
    build_engine(src, tmp_path / "plain", progress=False)
    build_engine(src, tmp_path / "fp8", quantization=FP8_HEAD, progress=False)
    _set_lm_head(tmp_path / "plain", "fp8")
    with pytest.raises(EngineFormatError, match=r"says quantization lm_head 'fp8' but its "
                       r"weights have no FP8 lm_head.*rebuild the engine"):
        load_engine(tmp_path / "plain").load_weights()
    _set_lm_head(tmp_path / "fp8", "none")
    with pytest.raises(EngineFormatError, match=r"lm_head 'none' but its weights have an FP8"):
        load_engine(tmp_path / "fp8").load_weights()


def test_hf_baseline_dequantizes_the_fp8_head(tiny_hf_model, tmp_path):
    """`--baseline hf` on a tied engine with an FP8 head: transformers runs it untied, the
    head dequantized, the embedding as it is."""
    build_engine(str(tiny_hf_model("qwen3")), tmp_path / "e", dtype="float32",
                 quantization=FP8_HEAD, progress=False)
    w = load_engine(tmp_path / "e").load_weights()
    model, info = build_hf_model(str(tmp_path / "e"), "cpu")
    assert info["dequantized_fp8_linears"] == 1
    head = w["lm_head.weight"].float() * w["lm_head.weight_scale"][:, None]
    assert torch.equal(model.get_output_embeddings().weight, head)
    assert torch.equal(model.get_input_embeddings().weight, w["embed_tokens.weight"])


def test_cli_flag_help_build_and_inspect(tmp_path):
    from kiln.cli.app import app

    runner = CliRunner()
    res = runner.invoke(app, ["build", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--quantize-lm-head" in res.output
    assert "FP8 e4m3 with one scale per row" in res.output
    out = tmp_path / "e"
    res = runner.invoke(app, ["build", "random:tiny-qwen2", "-o", str(out), "--no-tune",
                              "--no-precompile-kernels", "--quantize-lm-head", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["quantization"]["lm_head"] == "fp8"
    res = runner.invoke(app, ["inspect", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert any("lm_head" in line and "fp8" in line for line in res.output.splitlines())
