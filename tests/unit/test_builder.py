"""kiln.builder: spec round trip, limits validation, build → load, atomicity, corruption."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.artifact.loader import load_engine
from kiln.artifact.spec import ENGINE_FORMAT_VERSION, EngineSpec, Limits
from kiln.artifact.speculative import SpeculativeConfig
from kiln.artifact.weights import runtime_shapes
from kiln.builder import build_engine
from kiln.errors import EngineFormatError, KilnError, SourceError
from kiln.sources.random import PRESETS


@pytest.fixture(scope="module")
def built(tiny_hf_model, tmp_path_factory):
    """arch -> engine dir built in float32 from the tiny HF checkpoint."""
    out = {}

    def get(arch: str) -> Path:
        if arch not in out:
            d = tmp_path_factory.mktemp("eng") / arch
            build_engine(str(tiny_hf_model(arch)), d, dtype="float32", progress=False)
            out[arch] = d
        return out[arch]

    return get


# ---- spec and limits -------------------------------------------------------------------


def test_limits_defaults_and_validation():
    lim = Limits()  # no model: DEFAULT_MAX_SEQ_LEN
    assert (lim.max_batch_size, lim.max_seq_len, lim.max_input_len, lim.max_num_tokens) == (
        256, 2048, 2047, 8192)
    with pytest.raises(ValueError, match="max_batch_size must be a positive"):
        Limits(max_batch_size=0)
    with pytest.raises(ValueError, match="max_input_len 100 must be < max_seq_len 100"):
        Limits(max_seq_len=100, max_input_len=100)
    tiny = PRESETS["tiny-llama"]
    assert Limits.for_model(tiny).max_seq_len == 512  # capped at max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        Limits(max_seq_len=1024).validate_for(tiny, SpeculativeConfig())


def test_limits_default_to_the_model_context():
    """Without limit flags: the model's context (at most its sliding window), a budget of
    8192 tokens a step, 256 sequences (serve lowers it to what the KV memory holds)."""
    lim = Limits.for_model(PRESETS["llama-3-8b"])
    assert (lim.max_batch_size, lim.max_seq_len, lim.max_input_len, lim.max_num_tokens) == (
        256, 131072, 131071, 8192)
    windowed = dataclasses.replace(PRESETS["qwen2.5-7b"], sliding_window=4096)
    assert Limits.for_model(windowed).max_seq_len == 4096
    assert Limits.for_model(PRESETS["tiny-llama"], max_seq_len=100,
                            max_num_tokens=64).max_num_tokens == 64
    assert lim.describe(PRESETS["llama-3-8b"], {"max_batch_size"}) == (
        "max_seq_len 131,072 (the model's context), max_num_tokens 8,192 (default), "
        "max_batch_size 256 (--max-batch-size), max_input_len 131,071 (max_seq_len - 1); "
        "KV cache: sized by serve from the device's free memory")
    spec = SpeculativeConfig.from_cli("lookahead", lookahead_config="5,5,5")  # draft 39
    lim = Limits.for_model(windowed, speculative=spec)
    assert (lim.max_input_len, lim.max_num_tokens) == (4096 - 40, 8192)
    assert "max_seq_len 4,096 (the model's sliding window)" in lim.describe(windowed)
    assert "max_input_len 4,056 (max_seq_len - 1 - 39 draft tokens)" in lim.describe(windowed)


def test_limits_with_speculative():
    tiny = PRESETS["tiny-llama"]
    spec = SpeculativeConfig.from_cli("lookahead", lookahead_config="4,3,4")  # draft 15
    lim = Limits.for_model(tiny, speculative=spec)
    assert lim.max_input_len == 512 - 1 - 15
    lim.validate_for(tiny, spec)
    with pytest.raises(ValueError, match="max_num_tokens 8"):
        Limits(max_seq_len=512, max_input_len=400, max_num_tokens=8).validate_for(tiny, spec)


def test_spec_roundtrip():
    spec = EngineSpec(
        format_version=ENGINE_FORMAT_VERSION,
        kiln_version="0.1.0",
        model=PRESETS["llama-3-8b"],
        dtype="bfloat16",
        limits=Limits(),
        speculative=SpeculativeConfig.from_cli("lookahead", lookahead_config="5,5,5"),
        provenance={"kind": "random"},
        weights={"format": "random", "seed": 1, "std": 0.02},
    )
    d = json.loads(json.dumps(spec.to_dict()))
    assert EngineSpec.from_dict(d) == spec
    with pytest.raises(ValueError, match="dtype 'int3'"):
        EngineSpec.from_dict({**d, "dtype": "int3"})


# ---- build and load --------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_build_load_roundtrip_fused_weights_exact(built, tiny_hf_model, arch):
    eng = load_engine(built(arch))
    cfg = eng.spec.model
    assert eng.spec.dtype == "float32" and eng.spec.weights["format"] == "safetensors"
    w = eng.load_weights("cpu")
    assert {k: tuple(v.shape) for k, v in w.items()} == runtime_shapes(cfg)
    assert ("lm_head.weight" in w) == (not cfg.tie_word_embeddings)
    hf = load_file(tiny_hf_model(arch) / "model.safetensors")
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = torch.cat([hf[a + p + "_proj.weight"] for p in "qkv"])
        assert torch.equal(w[f"layers.{i}.qkv.weight"], qkv)
        gate_up = torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
        assert torch.equal(w[f"layers.{i}.gate_up.weight"], gate_up)
        assert torch.equal(w[f"layers.{i}.o_proj.weight"], hf[a + "o_proj.weight"])
        assert torch.equal(w[f"layers.{i}.down.weight"], hf[m + "down_proj.weight"])
        assert torch.equal(
            w[f"layers.{i}.post_norm.weight"],
            hf[f"model.layers.{i}.post_attention_layernorm.weight"],
        )
        if cfg.qkv_bias:
            bias = torch.cat([hf[a + p + "_proj.bias"] for p in "qkv"])
            assert torch.equal(w[f"layers.{i}.qkv.bias"], bias)
        if cfg.qk_norm:
            assert torch.equal(w[f"layers.{i}.k_norm.weight"], hf[a + "k_norm.weight"])
    assert torch.equal(w["embed_tokens.weight"], hf["model.embed_tokens.weight"])
    tok = eng.load_tokenizer()
    assert tok.eos_token_id == 257 and tok.chat_template
    gen = json.loads((eng.tokenizer_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [257]


def test_build_bfloat16_casts(tiny_hf_model, tmp_path):
    spec = build_engine(str(tiny_hf_model("qwen2")), tmp_path / "e", progress=False)
    assert spec.dtype == "bfloat16" and spec.quantization.kv_cache == "bfloat16"
    w = load_engine(tmp_path / "e").load_weights()
    assert w["layers.0.qkv.weight"].dtype == torch.bfloat16
    assert load_engine(tmp_path / "e").load_weights(dtype=torch.float32)[
        "norm.weight"].dtype == torch.float32


def test_random_engine_deterministic(tmp_path):
    spec = build_engine("random:tiny-qwen3:5", tmp_path / "a", progress=False)
    build_engine("random:tiny-qwen3:5", tmp_path / "b", progress=False)
    build_engine("random:tiny-qwen3:6", tmp_path / "c", progress=False)
    assert spec.weights == {"format": "random", "seed": 5, "std": 0.02}
    assert not (tmp_path / "a" / "weights.safetensors").exists()
    wa, wb = (load_engine(tmp_path / x).load_weights() for x in "ab")
    wc = load_engine(tmp_path / "c").load_weights()
    assert set(wa) == set(runtime_shapes(spec.model))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["layers.0.qkv.weight"], wc["layers.0.qkv.weight"])
    assert torch.equal(wa["layers.1.q_norm.weight"], torch.ones(32, dtype=torch.bfloat16))
    assert 0.015 < wa["embed_tokens.weight"].float().std() < 0.025


def test_random_8b_builds_fast(tmp_path):
    spec = build_engine("random:llama-3-8b", tmp_path / "e", progress=False)
    assert spec.model.num_params > 8e9
    assert spec.limits == Limits(256, 131072, 131071, 8192)  # no limit flags: the model's
    assert load_engine(tmp_path / "e").spec == spec


# ---- output directory handling and atomicity --------------------------------------------


def test_refuses_non_empty_out_dir_then_force_replaces(tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(KilnError, match="not empty; pass --force"):
        build_engine("random:tiny-llama", out, progress=False)
    assert (out / "keep.txt").exists()
    build_engine("random:tiny-llama", out, progress=False, force=True)
    assert not (out / "keep.txt").exists() and (out / "engine.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["e"]  # no temp dirs left


def test_failure_mid_build_leaves_nothing(tiny_hf_model, tmp_path, monkeypatch):
    import kiln.builder.writer as writer

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(writer, "_write_tokenizer", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        build_engine(str(tiny_hf_model("llama")), tmp_path / "e", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_failure_with_force_keeps_old_engine(tmp_path, monkeypatch):
    import kiln.builder.writer as writer

    build_engine("random:tiny-llama:1", tmp_path / "e", progress=False)
    before = (tmp_path / "e" / "engine.json").read_text()
    monkeypatch.setattr(writer, "_write_tokenizer", lambda *a: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):
        build_engine("random:tiny-llama:2", tmp_path / "e", progress=False, force=True)
    assert (tmp_path / "e" / "engine.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["e"]


def test_invalid_limits_fail_before_writing(tmp_path):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        build_engine("random:tiny-llama", tmp_path / "e", max_seq_len=4096, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_missing_and_extra_tensors(tiny_hf_model, tmp_path):
    from safetensors.torch import save_file

    d = shutil.copytree(tiny_hf_model("llama"), tmp_path / "m")
    t = load_file(d / "model.safetensors")
    t2 = dict(t)
    del t2["model.layers.1.mlp.up_proj.weight"]
    save_file(t2, d / "model.safetensors")
    with pytest.raises(SourceError, match="missing.*model.layers.1.mlp.up_proj.weight"):
        build_engine(str(d), tmp_path / "e", progress=False)
    save_file({**t, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, d / "model.safetensors")
    with pytest.raises(SourceError, match="model.layers.0.mlp.extra.weight"):
        build_engine(str(d), tmp_path / "e", progress=False)
    assert not (tmp_path / "e").exists()


# ---- loader errors ----------------------------------------------------------------------


def _copy(src: Path, tmp_path: Path) -> Path:
    return shutil.copytree(src, tmp_path / "copy")


def test_checksum_mismatch_detected(built, tmp_path):
    d = _copy(built("llama"), tmp_path)
    f = d / "weights.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(EngineFormatError, match=r"checksum mismatch.*weights.safetensors.*rebuild"):
        load_engine(d)
    load_engine(d, verify_checksums=False)  # opt-out works


def test_newer_format_version_rejected(built, tmp_path):
    d = _copy(built("llama"), tmp_path)
    spec = json.loads((d / "engine.json").read_text())
    spec["format_version"] = ENGINE_FORMAT_VERSION + 1
    spec["kiln_version"] = "9.0.0"
    (d / "engine.json").write_text(json.dumps(spec))
    newer, newest = ENGINE_FORMAT_VERSION + 1, ENGINE_FORMAT_VERSION
    with pytest.raises(EngineFormatError,
                       match=rf"kiln 9.0.0 with format {newer}.*reads up to format {newest}"):
        load_engine(d)


def test_loader_errors(built, tmp_path):
    with pytest.raises(EngineFormatError, match="does not exist"):
        load_engine(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineFormatError, match="not a kiln engine"):
        load_engine(tmp_path / "empty")
    d = _copy(built("llama"), tmp_path)
    (d / "weights.safetensors").unlink()
    with pytest.raises(EngineFormatError, match="missing its weights file weights.safetensors"):
        load_engine(d)
    (d / "engine.json").write_text("{not json")
    with pytest.raises(EngineFormatError, match="not valid JSON"):
        load_engine(d)
