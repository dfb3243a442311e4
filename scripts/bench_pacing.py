"""Adaptive speculation's break-even, A/B on smollm2-135m bf16 lookahead (7,7,7) (the GGUF).

The graph-replay ratio of a speculative step to a decode step (~2.05 on the H200) leaves out
a speculative step's host work (~0.3-0.5 ms, which plain decode steps hide under async
scheduling); ``LLMEngine.measure_step_ms`` times whole engine steps (~2.8), and since the
seventh session of 2026-11-30 that is the engine's default. This runs the same engine with
no pacing ("always"), the replay break-even and the wall-clock one with several of pace.py's
knobs (MIN_STEPS, PROBE_STEPS, PAUSE_GROWTH: probes of 12 speculative steps at ~1.2 tokens
each are what chat prompts pay), alternating, on the code and chat prompt sets
(kiln.bench.speculative).

    KILN_CACHE=... PYTHONPATH=. python3 scripts/bench_pacing.py [--repeats 2] [--out r.json]
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

from kiln.bench.speculative import run_speculative_latency
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.speculative import pace


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", default="7,7,7")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompts-per-set", type=int, default=3, help="of the 6 code / 6 chat")
    ap.add_argument("--out", default=None)
    ap.add_argument("--source", default=None, help="default: the smollm2 GGUF when cached, "
                    "else random:smollm2-135m (a CPU smoke run: random:tiny-llama)")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--policies", default="always,replay,wall:12:12:2,wall:12:4:2,wall:12:4:4",
                    help="comma-separated: always | replay | wall[:MIN_STEPS:PROBE_STEPS:"
                    "PAUSE_GROWTH:EARLY_STEPS:EARLY_FRACTION] (pace.py's module constants, "
                    "the ones not given at their defaults)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    source, out = build_smol(Path(tempfile.mkdtemp()), max_batch_size=8, window=args.window,
                             dtype="bfloat16" if cuda else "float32",
                             max_seq_len=args.max_seq_len, source=args.source)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cuda" if cuda else "cpu",
                                                       adaptive_speculation=True))
    replay_be = eng.replay_break_even()
    startup_be = eng.spec_break_even  # what the engine measured at start-up (its default)
    walls = [eng.measure_step_ms(steps=32, warmup=8) for _ in range(3)]
    plain_ms = statistics.median(w["plain"] for w in walls)
    spec_ms = statistics.median(w["spec"] for w in walls)
    wall_be = spec_ms / plain_ms
    res: dict = {"card": torch.cuda.get_device_name() if cuda else "cpu", "date": time.strftime("%Y-%m-%d"),
                 "source": source, "window": args.window, "replay_break_even": replay_be,
                 "startup_break_even": startup_be,
                 "walls_ms": walls, "wall_break_even": wall_be, "runs": []}
    print(f"{res['card']} {res['date']} {source}, lookahead "
          f"({args.window}): replay break-even {_num(replay_be)}, start-up's "
          f"{_num(startup_be)}; steps {plain_ms:.3f} ms plain, "
          f"{spec_ms:.3f} ms speculative -> wall break-even {wall_be:.2f}", flush=True)
    defaults = (pace.MIN_STEPS, pace.PROBE_STEPS, pace.PAUSE_GROWTH, pace.EARLY_STEPS,
                pace.EARLY_FRACTION)
    policies = []
    for spec in args.policies.split(","):
        name, *knobs = spec.split(":")
        be = {"always": None, "replay": replay_be, "wall": wall_be}[name]
        given = tuple(float(k) if "." in k else int(k) for k in knobs)
        policies.append((spec, be, given + defaults[len(given):]))
    for rep in range(args.repeats):
        for name, be, knobs in policies:
            # read at each speculative step
            (pace.MIN_STEPS, pace.PROBE_STEPS, pace.PAUSE_GROWTH, pace.EARLY_STEPS,
             pace.EARLY_FRACTION) = knobs
            eng.spec_break_even = be  # read by add_request: each new request's pacing
            r = run_speculative_latency(eng, output_len=args.output_len,
                                        prompts_per_set=args.prompts_per_set,
                                        warmup=1 if rep == 0 else 0)
            row = {"policy": name, "break_even": be, "knobs": knobs, "repeat": rep,
                   "sets": {k: {kk: s[kk] for kk in ("plain_tokens_per_s", "spec_tokens_per_s",
                                                     "speedup", "tokens_per_step")}
                            for k, s in r["sets"].items()}}
            res["runs"].append(row)
            print(f"  {name:14} (break-even {_num(be)}) run {rep}: " + "; ".join(
                f"{k} x{s['speedup']:.2f} ({_num(s['tokens_per_step'])} tok/step)"
                for k, s in row["sets"].items()), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
