"""`kiln quantize` on CUDA: modelopt calibrates the bfloat16 model on the GPU, the quality gate
scores the checkpoint as a bfloat16 kiln engine on the GPU, and that score is what
`kiln build` + `kiln eval perplexity` of the written checkpoint measure on the same GPU.

Run in its own process:  python -m pytest -q tests/gpu/test_quantize_gpu.py
(nvidia-modelopt must be installed; the tests skip without it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="TRITON_INTERPRET is set in this process; run tests/gpu alone"),
]
pytest.importorskip("modelopt")


def kiln(*args):
    r = subprocess.run([sys.executable, "-m", "kiln", *map(str, args)], capture_output=True,
                       text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=600,
                       check=False)
    assert r.returncode == 0, f"kiln {args} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return r


@pytest.mark.parametrize("kv", ["fp8", "auto"])
def test_quantize_on_cuda_scores_what_the_engine_measures(tiny_hf_model, tmp_path, kv):
    src = tiny_hf_model("llama")
    ckpt, engine = tmp_path / "ckpt", tmp_path / "e"
    summary = json.loads(kiln("quantize", src, "-o", ckpt, "--kv-cache-dtype", kv,
                              "--calib-size", "6", "--calib-seq-len", "64", "--device", "cuda",
                              "--json").stdout)
    q = summary["quality"]
    assert summary["device"] == "cuda" and q["scored_by"] == "kiln engine (bfloat16, cuda)"
    assert abs(q["increase"]) < 0.03  # a tiny random model: FP8 costs it little
    kiln("build", ckpt, "-o", engine, "--dtype", "bfloat16", "--max-seq-len", "512",
         "--no-tune", "--no-precompile-kernels")
    spec = json.loads((engine / "engine.json").read_text())
    assert spec["quantization"]["kv_cache"] == ("fp8" if summary["kv_cache_dtype"] == "fp8"
                                                else "bfloat16")
    got = json.loads(kiln("eval", "perplexity", engine, "--json", "--device", "cuda").stdout)
    assert got["tokens"] == q["eval_tokens"]
    assert got["perplexity"] == pytest.approx(q["quantized_perplexity"], rel=2e-3)
