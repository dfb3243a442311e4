"""``kiln build --precompile-kernels``: ship the Triton kernels the engine compiles at start-up.

The built engine's first start runs in a subprocess whose Triton cache is an empty folder;
the entries it compiled then go into the engine's ``kernels/<tag>/``
(kiln.runtime.kernel_cache, which also installs them when the engine loads). `kiln build`
runs this on the engine's temp directory before the rename (``build_engine``'s ``finish``),
so an engine directory appears with all its kernels or none. A failure, a timeout
(``KILN_PRECOMPILE_TIMEOUT_S``, kiln/env.py) or no CUDA leaves the engine without them (it
still works: it compiles them when it first starts) and says why.

    python -m kiln.cli.precompile warm ENGINE_DIR   (the subprocess)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

WARM_ARGV = ["-m", "kiln.cli.precompile", "warm"]  # + the engine dir
# Prompt lengths the first start prefills: the small-batch GEMV picks its tiles per row
# count (1..GEMV_MAX_M), and longer prompts take the tensor-core and attention paths.
WARM_PROMPT_LENS = (*range(1, 10), 16, 17, 64, 200)


def precompile_kernels(engine_dir: Path, console: Console, timeout_s: float) -> None:
    """Start the engine in ``engine_dir`` once on this GPU (a subprocess with an empty Triton
    cache, stopped after ``timeout_s``) and export what it compiled into the engine."""
    import torch

    from kiln.runtime import kernel_cache

    if not torch.cuda.is_available():
        console.print("kernel precompilation skipped: no CUDA device at build time (build on "
                      "the serving GPU type to ship compiled kernels)")
        return
    torch.cuda.empty_cache()  # the first start gets the memory tuning held
    cache = Path(tempfile.mkdtemp(prefix="kiln-triton-cache-"))
    try:
        with console.status("Precompiling kernels (the engine's first start, on this GPU)"):
            try:
                proc = subprocess.run(
                    [sys.executable, *WARM_ARGV, str(engine_dir)],
                    env={**os.environ, "TRITON_CACHE_DIR": str(cache)}, capture_output=True,
                    text=True, check=False, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                Console(stderr=True).print(
                    f"[yellow]warning:[/] kernel precompilation did not finish in {timeout_s:g} "
                    "s and was stopped; the engine is built without shipped kernels and "
                    "compiles them when it first starts (KILN_PRECOMPILE_TIMEOUT_S sets the "
                    "limit)")
                return
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            Console(stderr=True).print(
                "[yellow]warning:[/] kernel precompilation failed (the engine compiles its "
                f"kernels when it first starts): {' | '.join(tail)}")
            return
        try:
            info = json.loads(proc.stdout.strip().splitlines()[-1])
            tag, seconds = info["tag"], float(info["seconds"])
        except (IndexError, ValueError, KeyError, TypeError):
            Console(stderr=True).print(
                "[yellow]warning:[/] kernel precompilation printed no result line (the engine "
                f"compiles its kernels when it first starts): {proc.stdout.strip()[-300:]!r}")
            return
        n = kernel_cache.export_kernels(cache, engine_dir, tag)
        console.print(f"precompiled {n} kernels for {tag} in {seconds:.1f} s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def warm(engine_dir: Path, device: str = "cuda") -> dict:
    """Start the engine on ``device`` (capturing its graphs) and prefill and decode a few
    prompts of the lengths in WARM_PROMPT_LENS, so the kernel variants serving needs are
    compiled into the current Triton cache."""
    from kiln.runtime import kernel_cache
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    t0 = time.perf_counter()
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device=device))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [n for n in WARM_PROMPT_LENS if n <= eng.limits.max_input_len]
    for n in prompts:
        eng.generate([[(7 * i + 11) % 100 + 1 for i in range(n)]], params)
    tag = kernel_cache.cache_tag() if device == "cuda" else None
    return {"tag": tag, "seconds": time.perf_counter() - t0, "prompts": prompts}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "warm":
        print("usage: python -m kiln.cli.precompile warm ENGINE_DIR", file=sys.stderr)
        return 2
    print(json.dumps(warm(Path(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
