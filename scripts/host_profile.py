"""Where the host's time goes in batch-1 decode steps (cProfile), greedy and sampled.

Builds a random smollm2-135m engine (max batch 64), then per temperature: one 256-token
request unprofiled (tok/s, median wall ms per step) and one under cProfile (the top
functions by own time). On the GPU a smollm2 step's graph is ~0.48 ms, so host work above
that is what the step costs. A benchmark, not a test.

    PYTHONPATH=.:scripts python3 scripts/host_profile.py [--temps 0,1] [--top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
from pathlib import Path

import torch
from profile_8b import timed_steps  # scripts/ is on sys.path when run as a script

from kiln.builder.writer import build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

PROMPT = list(range(1000, 1128))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--source", default="random:smollm2-135m")
    ap.add_argument("--seed", type=int, default=None, help="a per-request seed (host draws)")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp()) / "e"
    build_engine(args.source, out, dtype="bfloat16", max_seq_len=2048, max_num_tokens=8192,
                 max_batch_size=64, progress=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device=dev))
    eng.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    rows = []
    for t in (float(x) for x in args.temps.split(",")):
        p = SamplingParams(max_tokens=256, temperature=t, ignore_eos=True, seed=args.seed)
        for _ in range(2):
            steps, total = timed_steps(eng, PROMPT, p)
            rows.append(f"temperature {t}: {256 / total:.0f} tok/s, median step "
                        f"{statistics.median(steps[8:]) * 1e3:.3f} ms")
            print(rows[-1], flush=True)
        prof = cProfile.Profile()
        prof.enable()
        timed_steps(eng, PROMPT, p)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(f"--- cProfile, temperature {t}, one 256-token request (own time):")
        print("\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
