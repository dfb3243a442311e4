"""An engine built with --precompile-kernels starts on a machine with an empty Triton cache
without compiling anything: the shipped entries are installed and nothing else appears."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="compiled kernels, not the interpreter"),
]

START = """
import json, sys, time
from pathlib import Path
from triton import knobs
t0 = time.time()
misses = []  # Triton compiles that were not cache hits (the listener exists in triton >= 3.4)
if hasattr(knobs.compilation, "listener"):
    knobs.compilation.listener = lambda **kw: None if kw.get("cache_hit") else misses.append(1)
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams
eng = LLMEngine.from_engine_dir(sys.argv[1], RuntimeConfig(device="cuda"))
eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print(json.dumps({"installed": eng.kernels_installed, "times": eng.startup_times, "t0": t0,
                  "misses": len(misses)}))
"""


def test_precompiled_engine_starts_on_a_fresh_cache_without_compiling(tmp_path):
    from typer.testing import CliRunner

    from kiln.cli.app import app
    from kiln.runtime import kernel_cache

    out = tmp_path / "e"
    res = CliRunner().invoke(app, ["build", "random:tiny-llama", "-o", str(out), "--no-tune",
                                   "--precompile-kernels"])
    assert res.exit_code == 0, res.output
    tag = kernel_cache.cache_tag()
    assert kernel_cache.shipped_tags(out) == [tag]
    shipped = sum(1 for p in (out / "kernels" / tag).iterdir() if p.is_dir())
    assert shipped > 0
    fresh = tmp_path / "fresh-triton-cache"
    res = subprocess.run([sys.executable, "-c", START, str(out)], capture_output=True,
                         text=True, check=False,
                         env={**os.environ, "TRITON_CACHE_DIR": str(fresh)})
    assert res.returncode == 0, res.stderr[-2000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["installed"] == {"shipped": shipped, "installed": shipped}
    assert "install_kernels_s" in info["times"]
    # nothing compiled at start-up: no new entries, no Triton cache misses, and no kernel
    # file written after the start began (installed files keep the build's times; a
    # recompile into the same folder, which a copied group file without relocation caused,
    # rewrites them)
    assert sorted(p.name for p in fresh.iterdir() if p.is_dir()) == sorted(
        p.name for p in (out / "kernels" / tag).iterdir() if p.is_dir())
    assert info["misses"] == 0
    rewritten = [f.name for f in fresh.rglob("*") if f.is_file()
                 and not f.name.startswith("__grp__") and f.stat().st_mtime >= info["t0"]]
    assert rewritten == []
