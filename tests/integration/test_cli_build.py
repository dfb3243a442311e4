"""`kiln build` and `kiln inspect` through the real console entry point (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kiln(*args: str, timeout: float = 300,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


def test_build_and_inspect_random(tmp_path):
    out = tmp_path / "eng"
    r = kiln("build", "random:tiny-qwen2:3", "-o", str(out), "--max-seq-len", "256",
             "--speculative-decoding-mode", "lookahead", "--lookahead-config", "4,3,4", "--json")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    assert spec["limits"]["max_seq_len"] == 256 and spec["speculative"]["max_draft_len"] == 15
    # one line: what the build chose for each limit and where it came from
    assert ("kiln build: max_seq_len 256 (--max-seq-len), max_num_tokens 8,192 (default), "
            "max_batch_size 256 (default; serve runs fewer when the KV memory holds fewer), "
            "max_input_len 240 (max_seq_len - 1 - 15 draft tokens); KV cache: sized by serve "
            "from the device's free memory") in r.stderr.splitlines()
    r = kiln("inspect", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == spec
    r = kiln("inspect", str(out))
    assert r.returncode == 0 and "tiny-qwen2" in r.stdout and "lookahead" in r.stdout


def test_build_errors_are_one_line(tmp_path):
    r = kiln("build", str(tmp_path / "nope"), "-o", str(tmp_path / "e"))
    assert r.returncode == 1 and r.stderr.strip().startswith("error:")
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = kiln("build", "random:tiny-llama", "-o", str(tmp_path / "e"), "--max-seq-len", "9999")
    assert r.returncode == 1 and "max_position_embeddings 512" in r.stderr
    assert not (tmp_path / "e").exists()
    r = kiln("inspect", str(tmp_path))
    assert r.returncode == 1 and "not a kiln engine" in r.stderr


def test_build_smollm2_builtin(tmp_path, smollm2_gguf):
    """The real built-in model (cached GGUF in KILN_CACHE) → engine → inspect."""
    out = tmp_path / "smol"
    r = kiln("build", "smollm2-135m", "-o", str(out), "--max-seq-len", "1024", "--json")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    model = spec["model"]
    assert (model["num_layers"], model["hidden_size"], model["num_heads"],
            model["num_kv_heads"], model["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert model["tie_word_embeddings"] and model["eos_token_ids"] == [2]
    assert spec["provenance"]["kind"] == "builtin"
    assert spec["provenance"]["alias"] == "smollm2-135m"
    r = kiln("inspect", str(out), "--verify")
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m" in r.stdout and "weights.safetensors" in r.stdout
    assert (out / "tokenizer" / "chat_template.jinja").exists() or json.loads(
        (out / "tokenizer" / "tokenizer_config.json").read_text()).get("chat_template")


def test_build_without_dtype_and_without_cuda_is_float32(tmp_path):
    """As `kiln serve SOURCE` builds on the CPU: bfloat16 is slow on most CPUs."""
    r = kiln("build", "random:tiny-llama", "-o", str(tmp_path / "e"), "--max-seq-len", "128",
             "--json", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["dtype"] == "float32"
    assert ("kiln build: no CUDA device, so float32 (bfloat16 is slow on most CPUs); pass "
            "--dtype bfloat16 for an engine to run on a GPU") in r.stderr.splitlines()
    r = kiln("build", "random:tiny-llama", "-o", str(tmp_path / "b"), "--max-seq-len", "128",
             "--dtype", "bfloat16", "--json", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0 and json.loads(r.stdout)["dtype"] == "bfloat16", r.stderr
    assert "no CUDA device" not in r.stderr
