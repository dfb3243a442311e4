"""How steady is the wall-clock break-even (LLMEngine.measure_step_ms) from run to run?

smollm2-135m bf16 lookahead (7,7,7) engine (the GGUF when cached, else random weights of the
same shapes: the timings, not the acceptance, are what is measured here). For each step
count, ``--repeats`` runs of measure_step_ms back to back, and the spread of spec / plain.

    KILN_CACHE=... PYTHONPATH=.:scripts python3 scripts/break_even_noise.py [--out r.json]

A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_fast_path import build_smol  # scripts/ is on sys.path

from kiln.runtime.engine import LLMEngine, RuntimeConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="16,48,128")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    source, out = build_smol(Path(tempfile.mkdtemp()), max_batch_size=8,
                             dtype="bfloat16" if cuda else "float32")
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cuda" if cuda else "cpu",
                                                       adaptive_speculation=True))
    res = {"card": torch.cuda.get_device_name() if cuda else "cpu",
           "date": time.strftime("%Y-%m-%d"), "source": source,
           "startup_break_even": eng.spec_break_even, "runs": {}}
    print(f"{res['card']} {res['date']} {source}: start-up break-even "
          f"{eng.spec_break_even}", flush=True)
    for steps in (int(s) for s in args.steps.split(",")):
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            ms = eng.measure_step_ms(steps=steps, warmup=8)
            runs.append({**ms, "ratio": ms["spec"] / ms["plain"],
                         "seconds": time.perf_counter() - t})
        res["runs"][steps] = runs
        ratios = [r["ratio"] for r in runs]
        med3 = [statistics.median(ratios[i:i + 3]) for i in range(0, len(ratios) - 2, 3)]
        spec = " ".join(f"{r['spec']:.3f}" for r in runs)
        plain = " ".join(f"{r['plain']:.3f}" for r in runs)
        print(f"  {steps:4d} steps: spec ms {spec}", flush=True)
        print(f"             plain ms {plain}", flush=True)
        print(f"             ratio min {min(ratios):.2f} median {statistics.median(ratios):.2f} "
              f"max {max(ratios):.2f}; medians of 3: {' '.join(f'{m:.2f}' for m in med3)}; "
              f"{statistics.mean(r['seconds'] for r in runs):.3f} s per run", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
