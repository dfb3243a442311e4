"""`kiln generate` / `kiln bench` on a model source, not just an engine; the flag named in
errors; engines and checkpoints readable as the umask says; generation defaults from the
model, through build, inspect and generate. Real `kiln` subprocesses on tiny models."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def kiln(*args: str, env: dict | None = None, umask: int = -1,
         timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")]))}
    full_env.pop("KILN_DEBUG", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "kiln", *map(str, args)], capture_output=True,
                          text=True, env=full_env, timeout=timeout, check=False, umask=umask)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\n" \
                                 f"stderr:\n{proc.stderr}"
    return proc


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


# --- a source where an engine is expected ----------------------------------------------------


def test_generate_and_bench_build_a_source_once(tmp_path):
    """`kiln generate random:tiny-llama ...` builds the source into $KILN_CACHE/engines (as
    `kiln serve` does) and later commands, bench included, reuse that engine."""
    env = {"KILN_CACHE": str(tmp_path / "cache")}
    first = ok(kiln("generate", "random:tiny-llama", "hi", "--max-tokens", "2", "--json",
                    "--device", "cpu", env=env))
    assert json.loads(first.stdout)["token_ids"]
    assert "building random:tiny-llama" in first.stderr
    (built,) = (tmp_path / "cache" / "engines").iterdir()
    # a cached engine from a kiln without generation defaults is rebuilt, once
    raw = json.loads((built / "engine.json").read_text())
    del raw["generation_defaults"]
    (built / "engine.json").write_text(json.dumps(raw))
    again = ok(kiln("generate", "random:tiny-llama", "hi", "--max-tokens", "2", "--json",
                    "--device", "cpu", env=env))
    assert "built by an older kiln (no generation_defaults)" in again.stderr
    assert "generation_defaults" in json.loads((built / "engine.json").read_text())
    tp = ok(kiln("bench", "throughput", "random:tiny-llama", "--num-prompts", "2",
                 "--input-len", "4", "--output-len", "2", "--device", "cpu", env=env))
    lat = ok(kiln("bench", "latency", "random:tiny-llama", "--input-len", "4",
                  "--output-len", "2", "--num-iters", "1", "--warmup", "0", "--device", "cpu",
                  env=env))
    assert "building" not in tp.stderr + lat.stderr
    assert [p.name for p in (tmp_path / "cache" / "engines").iterdir()] == [built.name]


def test_a_model_directory_is_used_as_a_source(tiny_hf_model, tmp_path):
    env = {"KILN_CACHE": str(tmp_path / "cache")}
    proc = ok(kiln("generate", tiny_hf_model("llama"), "hi", "--max-tokens", "2", "--json",
                   "--device", "cpu", env=env))
    assert "model directory" in proc.stderr and "building" in proc.stderr
    assert json.loads(proc.stdout)["token_ids"]


def test_a_directory_that_is_neither_suggests_another_output(tmp_path):
    """A directory without engine.json or config.json: build an engine elsewhere (`kiln build
    MODEL -o <that dir>` would refuse a non-empty directory)."""
    stuff = tmp_path / "stuff"
    stuff.mkdir()
    (stuff / "notes.txt").write_text("not a model")
    for cmd in (("generate", stuff, "hi"), ("bench", "throughput", stuff),
                ("bench", "latency", stuff), ("serve", stuff)):
        line = one_line_error(kiln(*cmd, env={"KILN_CACHE": str(tmp_path / "cache")}))
        assert "engine.json" in line and "config.json" in line, line
        assert f"-o {stuff}-engine" in line and f"-o {stuff}`" not in line, line
    assert not (tmp_path / "cache").exists()


def test_inspect_on_a_model_directory_says_how_to_build_it(tiny_hf_model):
    src = tiny_hf_model("llama")
    line = one_line_error(kiln("inspect", src))
    assert "model directory" in line and f"kiln build {src} -o {src}-engine" in line, line


def test_a_missing_path_still_says_build_it_there(tmp_path):
    line = one_line_error(kiln("generate", tmp_path / "engines" / "smol", "hi"))
    assert "does not exist" in line and f"kiln build MODEL -o {tmp_path}/engines/smol" in line


# --- the flag a user typed is the flag the error names ---------------------------------------


@pytest.mark.parametrize("cmd", [("generate", "random:tiny-llama", "hi"),
                                 ("bench", "latency", "random:tiny-llama")])
def test_lookahead_errors_name_the_lookahead_flag(cmd, tmp_path):
    env = {"KILN_CACHE": str(tmp_path / "cache")}
    line = one_line_error(kiln(*cmd, "--lookahead", "3,3", env=env))
    assert "--lookahead '3,3'" in line and "--lookahead-config" not in line, line
    line = one_line_error(kiln(*cmd, "--lookahead", "2,1,1", env=env))
    assert "--lookahead (2,1,1)" in line and "--lookahead-config" not in line, line
    assert not (tmp_path / "cache").exists()  # checked before anything is built


# --- the umask -------------------------------------------------------------------------------


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)) or ".": stat.S_IMODE(p.stat().st_mode)
            for p in [root, *root.rglob("*")]}


def test_engines_honour_the_umask(tiny_hf_model, tmp_path):
    """Engine directories were 0700 (mkdtemp): a server running as another user could not
    read them. With umask 027 they are 0750 / 0640 (with the usual 022, 0755 / 0644)."""
    umask = 0o027
    for source in ("random:tiny-llama", tiny_hf_model("llama")):
        out = tmp_path / f"e-{len(str(source))}"
        ok(kiln("build", source, "-o", out, "--dtype", "float32", umask=umask))
        found = modes(out)
        assert found["."] == 0o777 & ~umask, oct(found["."])
        for name, mode in found.items():
            want = 0o777 & ~umask if (out / name).is_dir() else 0o666 & ~umask
            assert mode == want, (name, oct(mode), oct(want))
        assert "engine.json" in found and "tokenizer" in found


def test_quantized_checkpoints_honour_the_umask(tiny_hf_model, tmp_path):
    pytest.importorskip("modelopt")
    ckpt = tmp_path / "ckpt"
    ok(kiln("quantize", tiny_hf_model("llama"), "-o", ckpt, "--calib-size", "1",
            "--calib-seq-len", "16", "--device", "cpu", umask=0o027))
    found = modes(ckpt)
    assert found["."] == 0o750 and found["config.json"] == 0o640, found
    assert all(m == (0o750 if (ckpt / n).is_dir() else 0o640) for n, m in found.items()), found


# --- generation defaults ---------------------------------------------------------------------

DEFAULTS = {"temperature": 0.3, "top_p": 0.8, "top_k": 7, "min_p": 0.05,
            "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def model_with_defaults(tiny_hf_model, tmp_path_factory) -> Path:
    """The tiny llama checkpoint with a generation_config.json that sets every default."""
    src = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(tiny_hf_model("llama"), src)
    path = src / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    (src / "generation_config.json").write_text(json.dumps({**gen, **DEFAULTS,
                                                            "do_sample": True}))
    return src


def generate_sampling(engine: Path, *args: str) -> dict:
    out = ok(kiln("generate", engine, "hi", "--max-tokens", "2", "--json", "--device", "cpu",
                  *args)).stdout
    return json.loads(out)["sampling"]


def test_generation_defaults_build_inspect_generate(model_with_defaults, tmp_path):
    engine = tmp_path / "e"
    spec = json.loads(ok(kiln("build", model_with_defaults, "-o", engine, "--dtype", "float32",
                              "--json")).stdout)
    gd = spec["generation_defaults"]
    assert gd["values"] == DEFAULTS and "generation_config.json" in gd["source"]
    assert spec["format_version"] == 1  # an optional field: older kilns ignore it
    shown = ok(kiln("inspect", engine)).stdout
    assert "Generation defaults" in shown and "repetition_penalty" in shown and "0.05" in shown
    assert json.loads(ok(kiln("inspect", engine, "--json")).stdout)["generation_defaults"] == gd

    assert {k: generate_sampling(engine)[k] for k in DEFAULTS} == DEFAULTS
    given = generate_sampling(engine, "--temperature", "0", "--top-k", "0")
    assert given["temperature"] == 0 and given["top_k"] == 0 and given["top_p"] == 0.8


def test_generation_config_none_records_nothing(model_with_defaults, tmp_path):
    engine = tmp_path / "e"
    spec = json.loads(ok(kiln("build", model_with_defaults, "-o", engine, "--dtype", "float32",
                              "--generation-config", "none", "--json")).stdout)
    assert spec["generation_defaults"]["values"] == {}
    assert "--generation-config none" in spec["generation_defaults"]["source"]
    sampling = generate_sampling(engine)
    assert (sampling["temperature"], sampling["top_p"], sampling["repetition_penalty"]) == \
        (0.7, 1.0, 1.0)  # kiln generate's own defaults
    bad = kiln("build", model_with_defaults, "-o", tmp_path / "x", "--generation-config", "vllm")
    assert bad.returncode == 2 and "--generation-config" in bad.stderr


def test_speculative_engines_drop_a_default_repetition_penalty(model_with_defaults, tmp_path):
    """A default repetition penalty would make every request decode plainly on a lookahead
    engine: it is dropped at build with one warning line, and the drop is recorded."""
    engine = tmp_path / "la"
    proc = ok(kiln("build", model_with_defaults, "-o", engine, "--dtype", "float32",
                   "--speculative-decoding-mode", "lookahead", "--lookahead-config", "2,2,1",
                   "--json"))
    gd = json.loads(proc.stdout)["generation_defaults"]
    assert gd["values"] == {k: v for k, v in DEFAULTS.items() if k != "repetition_penalty"}
    assert gd["dropped"]["repetition_penalty"]["value"] == 1.1
    assert "speculative" in gd["dropped"]["repetition_penalty"]["reason"]
    warnings = [ln for ln in proc.stderr.splitlines() if "repetition_penalty" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("warning:"), proc.stderr
    assert "speculative" in warnings[0] and "plain" in warnings[0]
    assert generate_sampling(engine)["repetition_penalty"] == 1.0


def test_the_engine_exposes_its_generation_defaults(model_with_defaults, tmp_path):
    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig

    build_engine(str(model_with_defaults), tmp_path / "e", dtype="float32", max_seq_len=64,
                 progress=False)
    engine = LLMEngine.from_engine_dir(tmp_path / "e", RuntimeConfig(device="cpu"))
    assert engine.generation_defaults == DEFAULTS
    build_engine("random:tiny-llama", tmp_path / "r", dtype="float32", max_seq_len=64,
                 progress=False)
    assert LLMEngine.from_engine_dir(tmp_path / "r", RuntimeConfig(device="cpu")) \
        .generation_defaults == {}
