"""`kiln build --tp N`: the split rules, their errors, the per-rank shard files (each the
tp-1 engine's tensor sliced, FP8 scales kept), engine.json's ``parallel`` section, old
engines without it, and `kiln inspect`."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY
from helpers import write_compressed_tensors
from safetensors.torch import load_file

from kiln.artifact.loader import load_engine
from kiln.artifact.parallel import ParallelConfig, shard_file, valid_tp
from kiln.artifact.weights import FP8
from kiln.builder import build_engine
from kiln.config import ModelConfig
from kiln.errors import EngineFormatError


def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    return ModelConfig(**{**base, **kw})


def test_tp_that_does_not_split_the_model_is_one_clear_error():
    smol = _cfg(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
    assert valid_tp(smol) == [1, 3]
    with pytest.raises(ValueError, match=r"--tp 2: num_attention_heads=9 is not divisible by "
                       r"tp=2 .*9 heads, 3 KV heads.*splits with --tp 1, 3"):
        ParallelConfig.for_model(smol, 2)
    # 6 heads and 3 KV heads: tp 2 splits the query heads but not the KV heads
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 is neither divisible by tp=2"
                       r".*splits with --tp 1, 3, 6"):
        ParallelConfig.for_model(_cfg(num_heads=6, num_kv_heads=3, intermediate_size=192), 2)
    with pytest.raises(ValueError, match=r"intermediate_size=130 is not divisible by tp=4"):
        ParallelConfig.for_model(_cfg(intermediate_size=130), 4)
    with pytest.raises(ValueError, match=r"--tp must be a positive integer, got 0"):
        ParallelConfig.for_model(_cfg(), 0)
    assert ParallelConfig.for_model(_cfg(), 1) is None


def test_smollm2_shape_fails_at_build_before_any_weight(tmp_path):
    with pytest.raises(ValueError, match=r"num_attention_heads=9 is not divisible by tp=2"):
        build_engine("random:smollm2-135m", tmp_path / "e", tp=2, progress=False)
    assert not (tmp_path / "e").exists()
    spec = build_engine("random:smollm2-135m", tmp_path / "e3", tp=3, progress=False)
    assert (spec.parallel.kv_heads, spec.parallel.vocab_size_padded) == ("split", 49152)


def test_kv_heads_split_or_replicated_follow_the_query_heads():
    cfg = _cfg()  # 4 heads, 2 KV heads: head h reads KV head h // 2
    hd, q, kv = cfg.head_dim, cfg.q_size, cfg.kv_size
    qkv = torch.arange(q + 2 * kv, dtype=torch.float32)[:, None].expand(-1, 3)

    def heads(t, first):  # [rows, 3] → head indices (rows // hd) of the q/k/v block
        return sorted({int(v) // hd - first for v in t[:, 0]})

    for tp, kv_mode, kv_of_rank in ((2, "split", [[0], [1]]),
                                     (4, "replicated", [[0], [0], [1], [1]])):
        par = ParallelConfig.for_model(cfg, tp)
        assert par.kv_heads == kv_mode
        local = par.local_config(cfg)
        for r in range(tp):
            s = par.shard(cfg, "layers.0.qkv.weight", qkv, r)
            assert s.shape == par.shard_shape(cfg, "layers.0.qkv.weight", tuple(qkv.shape))
            qs, ks, vs = s.split([local.q_size, local.kv_size, local.kv_size])
            assert heads(qs, 0) == list(range(r * 4 // tp, (r + 1) * 4 // tp))
            assert heads(ks, q // hd) == kv_of_rank[r] == heads(vs, (q + kv) // hd)


def test_vocab_pad_rows_are_zero_and_their_scales_one():
    cfg = _cfg(vocab_size=301)
    par = ParallelConfig.for_model(cfg, 2)
    assert par.vocab_size_padded == 302
    w = torch.randn(301, 64)
    last = par.shard(cfg, "lm_head.weight", w, 1)
    assert last.shape == (151, 64) and torch.equal(last[:150], w[151:]) and not last[150].any()
    scale = par.shard(cfg, "lm_head.weight_scale", torch.rand(301), 1)
    assert scale[150] == 1.0
    with pytest.raises(ValueError, match=r"no tensor-parallel shard rule for the 2-d tensor "
                       r"'layers.0.mystery.weight'"):
        par.shard(cfg, "layers.0.mystery.weight", w, 0)


def _tensors(path):
    return load_file(str(path))


@pytest.mark.parametrize("fp8", [False, "tensor", "channel"],
                         ids=["float32", "fp8", "fp8-per-channel"])
def test_shards_are_the_tp1_tensors_sliced_and_checksummed(tiny_hf_model, tmp_path, fp8):
    """Every rank file holds exactly ``ParallelConfig.shard`` of the tp-1 engine's tensor
    (Qwen2: the qkv bias too; FP8: e4m3 bytes sliced, per-tensor scales kept, the FP8
    lm_head's per-row scales sliced, per-channel linears' row scales split with their rows
    on qkv / gate_up and whole on o_proj / down); the loader reads a rank's file."""
    src = tiny_hf_model("qwen2")
    if fp8:
        src = write_compressed_tensors(src, tmp_path / "ct", dynamic=True, kv=True,
                                       strategy=fp8)
    opts = dict(dtype="float32", progress=False, max_seq_len=128, tune=False)
    if fp8:
        from kiln.artifact.spec import QuantConfig
        opts["quantization"] = QuantConfig(lm_head="fp8")
    one = build_engine(str(src), tmp_path / "tp1", **opts)
    two = build_engine(str(src), tmp_path / "tp2", tp=2, **opts)
    assert one.parallel is None and one.tp == 1
    files = [shard_file(r, 2) for r in range(2)]
    assert two.parallel.shards == tuple(files) and set(two.weights["files"]) == set(files)
    assert two.format_version == 4
    full = _tensors(tmp_path / "tp1" / "weights.safetensors")
    cfg = one.model
    for r, f in enumerate(files):
        part = _tensors(tmp_path / "tp2" / f)
        assert set(part) == set(full)
        for name, t in full.items():
            want = two.parallel.shard(cfg, name, t, r)
            assert part[name].dtype == t.dtype == want.dtype, name
            assert torch.equal(part[name].float(), want.float()), name  # e4m3 exactly too
    if fp8:
        assert full["layers.0.qkv.weight"].dtype == torch.float8_e4m3fn
        assert part["lm_head.weight_scale"].shape == (cfg.vocab_size // 2,)
    if fp8 == "tensor":
        assert torch.equal(part["layers.0.qkv.weight_scale"], full["layers.0.qkv.weight_scale"])
    if fp8 == "channel":
        local = two.parallel.local_config(cfg)
        for lin, rows in (("qkv", local.q_size + 2 * local.kv_size),
                          ("gate_up", 2 * local.intermediate_size),
                          ("o_proj", cfg.hidden_size), ("down", cfg.hidden_size)):
            assert part[f"layers.0.{lin}.weight_scale"].shape == (rows,), lin
    art = load_engine(tmp_path / "tp2")  # checks every shard's sha256
    loaded = art.load_weights("cpu", rank=1)
    assert torch.equal(loaded["layers.1.qkv.bias"],
                       two.parallel.shard(cfg, "layers.1.qkv.bias", full["layers.1.qkv.bias"], 1))
    with pytest.raises(ValueError, match=r"rank 2 is not a rank of this tp=2 engine"):
        art.load_weights("cpu", rank=2)


def test_a_corrupt_or_missing_shard_is_named(tiny_hf_model, tmp_path):
    out = tmp_path / "tp2"
    build_engine(str(tiny_hf_model("llama")), out, tp=2, dtype="float32", progress=False,
                 max_seq_len=128, tune=False)
    shard = out / shard_file(1, 2)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(EngineFormatError, match=r"checksum mismatch for .*weights-rank1-of-2"):
        load_engine(out)
    raw = json.loads((out / "engine.json").read_text())
    raw["parallel"]["shards"][1] = "elsewhere.safetensors"
    (out / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(EngineFormatError, match=r"parallel.shards.*missing \['elsewhere"):
        load_engine(out, verify_checksums=False)


def test_engines_without_the_section_are_tp1_and_older_kilns_refuse_tp_engines(
        tmp_path, monkeypatch):
    from kiln.artifact import loader

    build_engine("random:tiny-llama", tmp_path / "one", progress=False)
    build_engine("random:tiny-llama", tmp_path / "two", tp=2, progress=False)
    raw = json.loads((tmp_path / "one" / "engine.json").read_text())
    assert "parallel" not in raw and raw["format_version"] == 1
    assert load_engine(tmp_path / "one").spec.tp == 1
    raw2 = json.loads((tmp_path / "two" / "engine.json").read_text())
    assert raw2["format_version"] == 4
    assert raw2["parallel"] == {"tp": 2, "kv_heads": "split", "vocab_size_padded": 512,
                                "shards": [], "layout": raw2["parallel"]["layout"]}
    monkeypatch.setattr(loader, "ENGINE_FORMAT_VERSION", 3)  # a kiln from before --tp
    load_engine(tmp_path / "one")
    with pytest.raises(EngineFormatError, match=r"format 4.*reads up to format 3.*upgrade"):
        load_engine(tmp_path / "two")


@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
def test_a_random_engine_shards_its_seeded_weights_at_load(tmp_path, fp8):
    """A rank makes its random weights group by group (never the whole model at once) and
    keeps exactly its shard of the tp-1 engine's (FP8: quantized before slicing: the same
    per-tensor scales; tied qwen2's FP8 head made from the whole embedding)."""
    from kiln.artifact.spec import QuantConfig
    from kiln.runtime.models.calibration import ActivationCalibrator

    q = QuantConfig("fp8", "fp8", "fp8", lm_head="fp8") if fp8 else None
    opts = dict(dtype="float32", progress=False, quantization=q)
    build_engine("random:tiny-qwen2", tmp_path / "one", **opts)
    build_engine("random:tiny-qwen2", tmp_path / "two", tp=2, **opts)
    full = load_engine(tmp_path / "one").load_weights(calibrator=ActivationCalibrator)
    art = load_engine(tmp_path / "two")
    assert ("layers.1.k_scale" in full) == fp8
    assert ("lm_head.weight" in full and full["lm_head.weight"].dtype == FP8) == fp8
    for r in range(2):
        part = art.load_weights(rank=r, calibrator=ActivationCalibrator)
        assert set(part) == set(full)
        for name, t in full.items():
            want = art.spec.parallel.shard(art.spec.model, name, t, r)
            assert part[name].dtype == want.dtype and torch.equal(part[name].float(),
                                                                  want.float()), name


def test_inspect_shows_tp_and_the_rank_files(tiny_hf_model, tmp_path, capsys):
    from kiln.cli.inspect import inspect

    out = tmp_path / "tp2"
    build_engine(str(tiny_hf_model("llama")), out, tp=2, dtype="float32", progress=False,
                 max_seq_len=128, tune=False)
    inspect(out, as_json=False, verify=True)
    text = capsys.readouterr().out
    assert "Tensor parallelism" in text and "split (2 KV heads, 1 per rank)" in text
    for r in range(2):
        assert f"rank {r}" in text and shard_file(r, 2) in text
    inspect(out, as_json=True, verify=False)
    spec = json.loads(capsys.readouterr().out)
    assert spec["parallel"]["tp"] == 2
    assert spec["parallel"]["shards"] == [shard_file(0, 2), shard_file(1, 2)]
    assert TINY["num_attention_heads"] == spec["model"]["num_heads"]
