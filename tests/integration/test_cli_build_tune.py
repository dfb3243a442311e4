"""`kiln build --tune/--no-tune` on a machine without CUDA, and `kiln inspect` of the section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TUNED = {
    "tuned": True, "gpu": "NVIDIA H200", "capability": [9, 0], "triton": "3.6.0",
    "torch": "2.11.0+cu130", "tuned_at": "2026-11-30", "tune_s": 12.34,
    "configs": {"paged_attention": {
        "kvh2-qpk2-d16-bfloat16-kvbfloat16-decode": {
            "BLOCK_N": 32, "num_warps": 2, "num_stages": 3, "tiles_per_split": 2}},
        "gemv": {"1x128x64:bfloat16": {"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 1,
                                       "USE_DOT": False, "num_warps": 4, "num_stages": 1}}},
    "stats": {"paged_attention": {"kvh2-qpk2-d16-bfloat16-kvbfloat16-decode": {
        "default_us": [5.0], "best_us": [4.0], "speedup": 1.25, "candidates": 36}}},
    "skipped": {"paged_attention": 3, "gemv": 0}, "rejected": {"paged_attention": 0, "gemv": 0},
}


def kiln(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "kiln", *args], check=False,
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU build machine path")
def test_build_on_cpu_records_untuned(tmp_path):
    out = tmp_path / "auto"
    r = kiln("build", "random:tiny-llama", "-o", str(out), "--max-seq-len", "128")
    assert r.returncode == 0, r.stderr
    assert "kernel tuning skipped: no CUDA device at build time" in r.stderr
    # kernel precompilation is on by default too, and says why it shipped nothing
    assert "kernel precompilation skipped: no CUDA" in r.stderr
    assert not (out / "kernels").exists()
    spec = json.loads((out / "engine.json").read_text())
    assert spec["kernel_configs"] == {"tuned": False, "reason": "no CUDA device at build time"}
    assert spec["attention"] == {"backend": "auto", "source": "default",
                                 "reason": "no CUDA device at build time"}

    r = kiln("build", "random:tiny-llama", "-o", str(tmp_path / "off"), "--max-seq-len", "128",
             "--no-tune", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kernel_configs"] == {
        "tuned": False, "reason": "tuning not requested (--no-tune)"}
    assert json.loads(r.stdout)["attention"]["reason"] == "not measured (--no-tune)"

    r = kiln("inspect", str(out))
    assert r.returncode == 0 and "no CUDA device at build time" in r.stdout
    assert "Attention" in r.stdout and "auto: Triton on CUDA" in r.stdout


def test_build_attention_backend_flag(tmp_path):
    out = tmp_path / "fa"
    r = kiln("build", "random:tiny-llama", "-o", str(out), "--max-seq-len", "128",
             "--attention-backend", "flash-attn", "--no-tune", "--no-precompile-kernels")
    assert r.returncode == 0, r.stderr
    spec = json.loads((out / "engine.json").read_text())
    assert spec["attention"] == {"backend": "flash-attn", "source": "--attention-backend"}
    r = kiln("inspect", str(out))
    assert r.returncode == 0 and "--attention-backend" in r.stdout
    r = kiln("build", "random:tiny-llama", "-o", str(tmp_path / "bad"), "--max-seq-len", "128",
             "--attention-backend", "flashinfer")
    assert r.returncode != 0 and not (tmp_path / "bad").exists()
    assert "--attention-backend 'flashinfer' is unknown" in r.stderr and "triton" in r.stderr


def test_inspect_and_load_a_tuned_engine(tmp_path, capsys):
    from kiln.artifact.loader import load_engine
    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.kernels import tuning

    out = tmp_path / "eng"
    spec = build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=128,
                        max_batch_size=2, progress=False)
    assert spec.kernel_configs == {"tuned": False, "reason": "tuning not requested (--no-tune)"}
    raw = json.loads((out / "engine.json").read_text())
    (out / "engine.json").write_text(json.dumps({**raw, "kernel_configs": TUNED}))
    assert load_engine(out).spec.kernel_configs == TUNED  # engine.json round trip

    r = kiln("inspect", str(out))
    assert r.returncode == 0, r.stderr
    assert "NVIDIA H200" in r.stdout and "12.3 s" in r.stdout and "1.25x" in r.stdout
    assert "configs" in r.stdout and "│ 2 " in r.stdout.replace("┃", "│")
    r = kiln("inspect", str(out), "--json")
    assert json.loads(r.stdout)["kernel_configs"] == TUNED

    capsys.readouterr()
    engine = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))  # CPU: defaults
    assert tuning.active() == {} and capsys.readouterr().err == ""
    engine.add_request([1, 2, 3])
    assert engine.step() is not None
