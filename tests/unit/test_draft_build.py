"""Draft-model engines, build side: the flags, the draft checks, ENGINE/draft, the loader.

A draft-model engine (speculative mode "draft") holds its draft model as a complete engine
in ENGINE/draft, built in the same temp dir and renamed into place with the target; the
target's engine.json records the sha256 of draft/engine.json. The random presets all use
kiln's byte tokenizer, so any two of them make a valid pair; "another tokenizer" and "a
shorter context" are tiny local Hugging Face directories written here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from kiln.artifact.loader import load_engine
from kiln.artifact.spec import Limits
from kiln.artifact.speculative import MAX_DRAFT_MODEL_LEN, SpeculativeConfig, check_limits
from kiln.builder import build_engine
from kiln.builder.draft import check_draft
from kiln.errors import EngineFormatError, KilnError, SourceError
from kiln.sources import SourceModel, make_byte_tokenizer, open_source
from kiln.sources.random import PRESETS

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-qwen2:2"


def draft_cfg(k: int = 4, draft: str = DRAFT) -> SpeculativeConfig:
    return SpeculativeConfig.from_cli("draft", max_draft_len=k, draft_model=draft)


def build(out: Path, draft: str = DRAFT, k: int = 4, target: str = TARGET, **kw):
    kw = {"dtype": "float32", "max_seq_len": 128, "progress": False, **kw}
    return build_engine(target, out, speculative=draft_cfg(k, draft), **kw)


def write_hf_draft(out: Path, *, tokenizer=None, max_position_embeddings: int = 512,
                   eos_token_id: int = 257, seed: int = 0) -> Path:
    """A tiny float32 llama checkpoint (vocab 320) with the byte tokenizer or ``tokenizer``."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=max_position_embeddings, bos_token_id=256,
        eos_token_id=eos_token_id, pad_token_id=257, tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    (tokenizer or make_byte_tokenizer()).save_pretrained(out)
    return out


def other_tokenizer():
    """The byte tokenizer plus one token: a vocabulary of 261, not 260."""
    tok = make_byte_tokenizer()
    tok.add_tokens(["<|fim_middle|>"])
    return tok


def assert_nothing_written(parent: Path) -> None:
    """No engine and no `.<name>.building-*` temp dir in ``parent``."""
    assert sorted(p.name for p in parent.iterdir()) == []


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    """A float32 tiny-llama engine drafted for by tiny-qwen2, K 4, max_seq_len 128."""
    out = tmp_path_factory.mktemp("draft") / "engine"
    build(out)
    return out


# ---- flags -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["draft", "draft_target", "draft_model", "draft-target",
                                  "Draft-Model", " DRAFT "])
@pytest.mark.parametrize("k", [1, 4, MAX_DRAFT_MODEL_LEN])
def test_from_cli_accepts_draft_mode_and_aliases(mode, k):
    c = SpeculativeConfig.from_cli(mode, max_draft_len=k, draft_model="random:tiny-qwen2")
    assert (c.mode, c.max_draft_len, c.tokens_per_step, c.enabled) == ("draft", k, k + 1, True)
    assert (c.draft_model, c.draft_engine, c.draft_sha256) == ("random:tiny-qwen2", None, None)
    assert c.lookahead is None
    assert SpeculativeConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("kw,needles", [
    ({"max_draft_len": 0}, ["--max-draft-len 0", "1 <= max_draft_len <= 16",
                            "--max-draft-len 4"]),
    ({"max_draft_len": 17}, ["--max-draft-len 17", "1 <= max_draft_len <= 16",
                             "--max-draft-len 4"]),
    ({"max_draft_len": -3}, ["--max-draft-len -3", "<= 16"]),
    ({"max_draft_len": None}, ["needs --max-draft-len K", "1 to 16", "--max-draft-len 4"]),
    ({"draft_model": None}, ["needs --draft-model SOURCE", "tokenizer",
                             "--draft-model qwen2.5-coder-0.5b"]),
    ({"draft_model": "  "}, ["needs --draft-model SOURCE"]),
    ({"draft_model": None, "max_draft_len": None},
     ["--draft-model SOURCE and --max-draft-len K", "--max-draft-len 4"]),
    ({"lookahead_config": "5,5,5"}, ["--lookahead-config 5,5,5", "'lookahead', not 'draft'",
                                     "drop it"]),
    ({"ngram_match": 3}, ["--ngram-match 3", "'ngram', not 'draft'", "drop it"]),
    ({"beam_width": 2}, ["--max-beam-width 2", "beam width 1", "--max-beam-width 1"]),
])
def test_from_cli_rejects_bad_draft_flags_naming_them(kw, needles):
    args = {"max_draft_len": 4, "draft_model": "random:tiny-qwen2", **kw}
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_cli("draft", **args)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


@pytest.mark.parametrize("mode,kw", [
    ("lookahead", {"lookahead_config": "5,5,5"}),
    ("ngram", {"max_draft_len": 4}),
])
def test_draft_model_with_another_mode_is_an_error(mode, kw):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_cli(mode, draft_model="random:tiny-qwen2", **kw)
    msg = str(e.value)
    assert "--draft-model random:tiny-qwen2 applies to mode 'draft'" in msg
    assert f"not {mode!r}" in msg and "--speculative-decoding-mode draft" in msg


def test_mode_none_lists_draft_model_among_the_given_flags():
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_cli("none", max_draft_len=4, draft_model="random:tiny-qwen2")
    msg = str(e.value)
    assert "--max-draft-len and --draft-model random:tiny-qwen2 given" in msg
    assert "mode is 'none'" in msg and "--speculative-decoding-mode draft" in msg
    # the other modes' message is unchanged
    with pytest.raises(ValueError, match="--max-draft-len given but .* mode is 'none'.*"
                                         "lookahead"):
        SpeculativeConfig.from_cli("none", max_draft_len=4)


def test_unknown_mode_lists_draft():
    with pytest.raises(ValueError, match="'medusa' is unknown: valid modes are none, "
                                         "lookahead, ngram, draft"):
        SpeculativeConfig.from_cli("medusa")


def test_constructor_checks_draft_fields():
    with pytest.raises(ValueError, match="draft_model 'x' is set but .* mode is 'ngram'.*"
                                         "--speculative-decoding-mode draft"):
        SpeculativeConfig(mode="ngram", max_draft_len=4, draft_model="x")
    for name in ("draft_engine", "draft_sha256"):
        with pytest.raises(ValueError, match=f"{name} .* is set but .* mode is 'none'"):
            SpeculativeConfig(**{name: "draft" if name == "draft_engine" else "0" * 64})
    with pytest.raises(ValueError, match="max_draft_len 17 is invalid .* 1 to 16"):
        SpeculativeConfig(mode="draft", max_draft_len=17, draft_model="x")
    with pytest.raises(ValueError, match="max_draft_len 0 is invalid"):
        SpeculativeConfig(mode="draft", draft_model="x")
    with pytest.raises(ValueError, match="records no draft model.*--draft-model SOURCE"):
        SpeculativeConfig(mode="draft", max_draft_len=4)
    for bad in ("../x", "", "a/b", ".."):
        with pytest.raises(ValueError, match="draft_engine .* is invalid"):
            SpeculativeConfig(mode="draft", max_draft_len=4, draft_model="x", draft_engine=bad)
    with pytest.raises(ValueError, match="draft_sha256 'abc' is invalid"):
        SpeculativeConfig(mode="draft", max_draft_len=4, draft_model="x", draft_sha256="abc")


def test_other_modes_sections_are_unchanged():
    keys = {"mode", "max_draft_len", "lookahead", "ngram_max_match", "ngram_min_match"}
    for c in (SpeculativeConfig(), SpeculativeConfig.from_cli("ngram", max_draft_len=4),
              SpeculativeConfig.from_cli("lookahead", "5,5,5")):
        assert set(c.to_dict()) == keys
        assert SpeculativeConfig.from_dict(c.to_dict()) == c


def test_check_limits_counts_k_plus_one():
    c = draft_cfg(k=8)
    assert check_limits(c, max_batch_size=2, max_seq_len=128, max_input_len=119,
                        max_num_tokens=64) == []
    with pytest.raises(ValueError, match="max_num_tokens 8 .* >= 1 \\+ max_draft_len = 9"):
        check_limits(c, max_batch_size=1, max_seq_len=128, max_input_len=100, max_num_tokens=8)
    with pytest.raises(ValueError, match="--max-seq-len 129"):
        check_limits(c, max_batch_size=1, max_seq_len=128, max_input_len=120,
                     max_num_tokens=64)
    assert Limits.for_model(PRESETS["tiny-llama"], max_seq_len=128,
                            speculative=c).max_input_len == 128 - 1 - 8


# ---- build ------------------------------------------------------------------------------


def test_build_writes_the_draft_engine_inside_the_target(engine):
    raw = json.loads((engine / "engine.json").read_text())
    sp = raw["speculative"]
    assert sp["mode"] == "draft" and sp["max_draft_len"] == 4
    assert sp["draft_model"] == DRAFT and sp["draft_engine"] == "draft"
    draft_json = engine / "draft" / "engine.json"
    assert sp["draft_sha256"] == hashlib.sha256(draft_json.read_bytes()).hexdigest()
    assert raw["format_version"] == 3  # a kiln that cannot load the draft says "upgrade"
    assert (engine / "draft" / "tokenizer" / "tokenizer.json").is_file()
    draft = json.loads(draft_json.read_text())
    assert draft["model"]["architecture"] == "qwen2" and draft["dtype"] == "float32"
    assert draft["limits"] == raw["limits"] == {
        "max_batch_size": 256, "max_seq_len": 128, "max_input_len": 123, "max_num_tokens": 8192}
    assert draft["speculative"] == SpeculativeConfig().to_dict()
    assert draft["quantization"]["weights"] == "none"
    assert draft["quantization"]["kv_cache"] == "float32"
    assert draft["generation_defaults"]["values"] == {}
    assert draft["weights"] == {"format": "random", "seed": 2, "std": 0.02}
    assert draft["provenance"] == {"kind": "random", "preset": "tiny-qwen2", "seed": 2}
    assert draft["kernel_configs"]["tuned"] is False
    assert draft["format_version"] == 1
    assert sorted(p.name for p in engine.parent.iterdir()) == ["engine"]  # no temp dirs


def test_load_engine_returns_the_draft(engine):
    art = load_engine(engine)
    assert art.draft is not None and art.draft.path == engine / "draft"
    assert art.draft.draft is None and art.draft.spec.speculative.mode == "none"
    assert art.draft.spec.model == PRESETS["tiny-qwen2"]
    assert art.draft.spec.dtype == art.spec.dtype == "float32"
    assert art.draft.spec.limits == art.spec.limits
    w = art.draft.load_weights("cpu")
    assert w["embed_tokens.weight"].shape == (512, 64)
    assert art.draft.load_tokenizer().get_vocab() == art.load_tokenizer().get_vocab()
    plain = build_engine(TARGET, engine.parent / "plain", dtype="float32", progress=False)
    assert load_engine(engine.parent / "plain").draft is None
    assert "draft_model" not in plain.to_dict()["speculative"]
    shutil.rmtree(engine.parent / "plain")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_draft_takes_the_targets_dtype(tmp_path, dtype):
    spec = build(tmp_path / "e", dtype=dtype, k=16)
    art = load_engine(tmp_path / "e")
    assert spec == art.spec and spec.speculative.max_draft_len == 16
    assert art.draft.spec.dtype == dtype and art.draft.spec.quantization.kv_cache == dtype


def test_a_local_checkpoint_draft_gets_checksummed_weights(tmp_path, capsys):
    src = write_hf_draft(tmp_path / "src")
    parent = tmp_path / "out"
    spec = build(parent / "e", draft=str(src), progress=True)
    err = "".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert f"buildingthedraftmodel{src}" in err and "draftllamaK=4" in err
    art = load_engine(parent / "e")
    files = art.draft.spec.weights["files"]
    assert set(files) == {"weights.safetensors"}
    assert art.draft.spec.model.vocab_size == 320  # padded tables may differ (512 here)
    assert art.spec.model.vocab_size == 512
    assert spec.speculative.draft_sha256 == hashlib.sha256(
        (parent / "e" / "draft" / "engine.json").read_bytes()).hexdigest()
    # a corrupt draft weight file fails the checksum the draft's engine.json records
    f = parent / "e" / "draft" / "weights.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(EngineFormatError, match=r"checksum mismatch for .*draft/weights"):
        load_engine(parent / "e")
    assert load_engine(parent / "e", verify_checksums=False).draft is not None


def test_other_eos_ids_only_warn(tmp_path, capsys):
    src = write_hf_draft(tmp_path / "src", eos_token_id=258)
    build(tmp_path / "out" / "e", draft=str(src))
    err = " ".join(capsys.readouterr().err.split())
    assert "eos token ids [258, 257], target" in err and "has [257]" in err and "warning" in err
    assert load_engine(tmp_path / "out" / "e").draft is not None


def test_force_replaces_an_engine_with_a_draft_engine(tmp_path):
    out = tmp_path / "e"
    build_engine(TARGET, out, dtype="float32", progress=False)
    build(out, force=True)
    assert (out / "draft" / "engine.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


# ---- build errors leave nothing ---------------------------------------------------------


@pytest.fixture
def no_materialize(monkeypatch):
    """Fail loudly if a source's weights are read: the draft checks come before that."""
    def boom(self):
        raise AssertionError("weights materialized before the draft checks")
    monkeypatch.setattr(SourceModel, "materialize", boom)


def test_another_tokenizer_fails_before_any_weight(tmp_path, no_materialize):
    src = write_hf_draft(tmp_path / "src", tokenizer=other_tokenizer())
    parent = tmp_path / "out"
    parent.mkdir()
    with pytest.raises(KilnError) as e:
        build(parent / "e", draft=str(src))
    msg = str(e.value)
    assert f"draft model {src} does not share the tokenizer of target {TARGET}" in msg
    assert "target 260 tokens vs draft 261" in msg
    assert "'<|fim_middle|>' absent in the target, id 260 in the draft" in msg
    assert "--draft-model" in msg and "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b" in msg
    assert "\n" not in msg
    assert_nothing_written(parent)


def test_a_shorter_draft_context_fails(tmp_path, no_materialize, monkeypatch):
    src = write_hf_draft(tmp_path / "src", max_position_embeddings=64)
    parent = tmp_path / "out"
    parent.mkdir()
    with pytest.raises(KilnError) as e:
        build(parent / "e", draft=str(src))  # --max-seq-len 128
    msg = str(e.value)
    assert f"draft model {src} has max_position_embeddings 64" in msg
    assert "max_seq_len 128" in msg and TARGET in msg
    assert "--max-seq-len 64" in msg and "at least 128 tokens" in msg
    assert_nothing_written(parent)
    monkeypatch.undo()  # weights may load now
    build(parent / "e", draft=str(src), max_seq_len=64)  # the fix works
    assert load_engine(parent / "e").draft.spec.limits.max_seq_len == 64


def test_a_shorter_draft_sliding_window_fails():
    target = open_source(TARGET)
    draft = open_source(DRAFT)
    draft.config = dataclasses.replace(draft.config, sliding_window=100)
    with pytest.raises(KilnError, match="has sliding_window 100, shorter than the engine's "
                                        "max_seq_len 128.*--max-seq-len 100"):
        check_draft(target, draft, Limits(max_seq_len=128), target_name="t", draft_name="d")
    assert check_draft(target, draft, Limits(max_seq_len=100), target_name="t",
                       draft_name="d") == []


@pytest.mark.parametrize("k,needle", [(0, "--max-draft-len 0"), (17, "--max-draft-len 17")])
def test_k_out_of_range_fails_before_the_build(tmp_path, k, needle):
    with pytest.raises(ValueError, match=f"{needle} is invalid for mode 'draft'.*"
                                         "1 <= max_draft_len <= 16"):
        build(tmp_path / "e", k=k)
    assert_nothing_written(tmp_path)


def test_draft_model_without_mode_draft_fails(tmp_path):
    with pytest.raises(ValueError, match="--draft-model random:tiny-qwen2 given but "
                                         "speculative decoding mode is 'none'"):
        SpeculativeConfig.from_cli("none", draft_model="random:tiny-qwen2")
    assert_nothing_written(tmp_path)


def test_k_beyond_the_token_budget_fails(tmp_path):
    with pytest.raises(ValueError, match="max_num_tokens 4 .* --max-num-tokens 9"):
        build(tmp_path / "e", k=8, max_num_tokens=4)
    assert_nothing_written(tmp_path)


def test_missing_draft_source_fails(tmp_path, no_materialize):
    with pytest.raises(SourceError, match="does-not-exist"):
        build(tmp_path / "e", draft=str(tmp_path / "does-not-exist"))
    assert_nothing_written(tmp_path)


def test_fp8_checkpoint_draft_is_refused(tiny_hf_model, tmp_path, no_materialize):
    from helpers import write_compressed_tensors

    src = write_compressed_tensors(tiny_hf_model("llama"), tmp_path / "fp8", dynamic=True,
                                   kv=False)
    parent = tmp_path / "out"
    parent.mkdir()
    with pytest.raises(KilnError, match="is an FP8 checkpoint .* unquantized model as "
                                        "--draft-model"):
        build(parent / "e", draft=str(src))
    assert_nothing_written(parent)


@pytest.mark.parametrize("fail_at", ["draft", "target"])
def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch, fail_at):
    from kiln.builder import writer

    real = writer._write_tokenizer

    def flaky(model, path):
        if (path.parent.name == "draft") == (fail_at == "draft"):
            raise OSError(f"disk full writing the {fail_at}")
        real(model, path)

    monkeypatch.setattr(writer, "_write_tokenizer", flaky)
    with pytest.raises(OSError, match=f"writing the {fail_at}"):
        build(tmp_path / "e")
    assert_nothing_written(tmp_path)


# ---- loader -----------------------------------------------------------------------------


@pytest.fixture
def copy(engine, tmp_path) -> Path:
    return shutil.copytree(engine, tmp_path / "copy")


def test_a_changed_draft_engine_json_is_refused(copy):
    f = copy / "draft" / "engine.json"
    want = json.loads((copy / "engine.json").read_text())["speculative"]["draft_sha256"]
    data = bytearray(f.read_bytes())
    i = data.index(b'"max_batch_size": 256') + len('"max_batch_size": 25')
    data[i:i + 1] = b"5"  # still valid JSON, one byte changed
    f.write_bytes(bytes(data))
    got = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(EngineFormatError) as e:
        load_engine(copy, verify_checksums=False)  # checked even without weight checks
    msg = str(e.value)
    assert f"checksum mismatch for {f}" in msg and want in msg and got in msg
    assert "rebuild the engine" in msg


def test_a_missing_draft_dir_is_refused(copy):
    shutil.rmtree(copy / "draft")
    with pytest.raises(EngineFormatError, match=r"draft-model engine but its draft engine "
                                                 r".*draft/engine.json is missing; rebuild"):
        load_engine(copy)


def _rewrite(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw, indent=2) + "\n")


@pytest.mark.parametrize("field", ["draft_engine", "draft_sha256"])
def test_a_draft_engine_json_without_its_draft_fields_is_refused(copy, field):
    _rewrite(copy / "engine.json", lambda raw: raw["speculative"].pop(field))
    with pytest.raises(EngineFormatError, match=f"mode 'draft' but no {field}.*rebuild"):
        load_engine(copy)
    _rewrite(copy / "engine.json", lambda raw: raw["speculative"].pop("draft_model"))
    with pytest.raises(EngineFormatError, match="malformed.*--draft-model"):
        load_engine(copy)


def _resign(copy: Path) -> None:
    """Record the current draft/engine.json's sha256 in the target's engine.json."""
    sha = hashlib.sha256((copy / "draft" / "engine.json").read_bytes()).hexdigest()
    _rewrite(copy / "engine.json", lambda raw: raw["speculative"].update(draft_sha256=sha))


def test_a_draft_of_another_dtype_is_refused(copy):
    _rewrite(copy / "draft" / "engine.json", lambda raw: raw.update(dtype="bfloat16"))
    _resign(copy)
    with pytest.raises(EngineFormatError, match="dtype 'bfloat16' but the engine .* "
                                                "'float32'.*rebuild"):
        load_engine(copy)


def test_a_speculative_draft_is_refused(copy):
    spec = SpeculativeConfig.from_cli("ngram", max_draft_len=2).to_dict()
    _rewrite(copy / "draft" / "engine.json", lambda raw: raw.update(speculative=spec))
    _resign(copy)
    with pytest.raises(EngineFormatError, match="speculative decoding mode 'ngram': a draft "
                                                "model decodes plainly"):
        load_engine(copy)


def test_an_engine_json_pointing_outside_is_refused(copy):
    _rewrite(copy / "engine.json",
             lambda raw: raw["speculative"].update(draft_engine="../elsewhere"))
    with pytest.raises(EngineFormatError, match="draft_engine '../elsewhere' is invalid"):
        load_engine(copy)


# ---- the real built-ins (only when cached: no download) ----------------------------------


def _cached(*aliases: str) -> bool:
    from kiln.sources.builtin import BUILTINS, cached_path

    return all(cached_path(BUILTINS[a]).is_file() for a in aliases)


@pytest.mark.slow
@pytest.mark.skipif(not _cached("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"),
                    reason="needs the cached built-in GGUFs (kiln build downloads them once)")
def test_qwen_coder_pair_shares_a_tokenizer_and_smollm2_does_not():
    target = open_source("qwen2.5-coder-1.5b", progress=False)
    limits = Limits(max_seq_len=2048)
    qwen = open_source("qwen2.5-coder-0.5b", progress=False)
    assert check_draft(target, qwen, limits, target_name="qwen2.5-coder-1.5b",
                       draft_name="qwen2.5-coder-0.5b") == []
    smol = open_source("smollm2-135m", progress=False)
    with pytest.raises(KilnError, match="draft model smollm2-135m does not share the tokenizer "
                                        "of target qwen2.5-coder-1.5b .*151,936 tokens vs "
                                        "draft 49,152"):
        check_draft(target, smol, limits, target_name="qwen2.5-coder-1.5b",
                    draft_name="smollm2-135m")
