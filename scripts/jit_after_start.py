"""Which Triton kernels compile *after* an engine is ready (a stall in the engine thread
while every request waits), and what the requests that hit them cost.

Starts an engine on CUDA (graph capture compiles what the graphs need), then runs a serving
mix one group at a time: single prompts of many lengths, greedy and sampled; a batch with
mixed temperatures; top-p / top-k / seeded / logprobs / penalty requests; a batch of prompts
of different lengths together. A Triton hook records every kernel variant that misses the
in-process cache (compiled, or loaded from the on-disk cache) with its time. A benchmark,
not a test.

    PYTHONPATH=.:scripts python3 scripts/jit_after_start.py [--source random:smollm2-135m]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import triton

from kiln.builder.writer import build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

LENGTHS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 129, 255, 256, 257,
           500, 777, 1000)
EVENTS: list[tuple[str, float, float]] = []  # (kernel, start time, compile seconds)
SPECS: list[str] = []  # each variant's specialisation, in EVENTS order
_open: dict = {}


def _hook(*, fn, key=None, **_kw):
    _open[(fn.name, str(key))] = time.perf_counter()


def _post(*, fn, key=None, compile=None, **_kw):
    t0 = _open.pop((fn.name, str(key)), time.perf_counter())
    EVENTS.append((fn.name, t0, time.perf_counter() - t0))
    consts = {k: v for k, v in (compile or {}).get("constants", {}).items()
              if v is not None}
    SPECS.append(f"{fn.name} {str(key)[:300]} {str(consts)[:300]}")


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 + salt) % 5000 + 100 for i in range(n)]


def run_group(eng: LLMEngine, name: str, reqs: list[tuple[list[int], SamplingParams]]) -> str:
    before = len(EVENTS)
    t0 = time.perf_counter()
    eng.generate([p for p, _ in reqs], [s for _, s in reqs])
    wall = time.perf_counter() - t0
    new = EVENTS[before:]
    comp = sum(c for _, _, c in new)
    names = sorted({n for n, _, _ in new})
    return (f"{name:38s} {wall * 1e3:8.1f} ms  compiles {len(new):2d} ({comp * 1e3:7.1f} ms)"
            f"  {', '.join(names)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default="random:smollm2-135m")
    ap.add_argument("--max-batch-size", type=int, default=64)
    args = ap.parse_args()
    knobs = triton.knobs.runtime
    knobs.jit_cache_hook, knobs.jit_post_compile_hook = _hook, _post
    out = Path(tempfile.mkdtemp()) / "e"
    build_engine(args.source, out, dtype="bfloat16", max_seq_len=2048, max_num_tokens=8192,
                 max_batch_size=args.max_batch_size, progress=False)
    t0 = time.perf_counter()
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cuda"))
    torch.cuda.synchronize()
    n_start = len(EVENTS)
    head = (f"start-up: {time.perf_counter() - t0:.1f} s, {n_start} kernel variants "
            f"({sum(c for *_, c in EVENTS):.1f} s of compile/load)")
    lines = [head]
    print(lines[-1], flush=True)
    g = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for t in (0.0, 0.8):
        for n in LENGTHS:
            s = SamplingParams(max_tokens=3, temperature=t, ignore_eos=True)
            lines.append(run_group(eng, f"len {n} temp {t}", [(prompt(n), s)]))
            print(lines[-1], flush=True)
    mixed = [SamplingParams(max_tokens=8, temperature=t, ignore_eos=True)
             for t in (0.0, 0.8, 1.0, 0.5)]
    groups = {
        "4 prompts, temps 0/0.8/1/0.5": [(prompt(20, i), s) for i, s in enumerate(mixed)],
        "top_p 0.9": [(prompt(20), SamplingParams(max_tokens=8, top_p=0.9, ignore_eos=True))],
        "top_k 50": [(prompt(20), SamplingParams(max_tokens=8, top_k=50, ignore_eos=True))],
        "seed 123": [(prompt(20), SamplingParams(max_tokens=8, seed=123, ignore_eos=True))],
        "logprobs 2": [(prompt(20), SamplingParams(max_tokens=8, logprobs=2,
                                                   ignore_eos=True))],
        "repetition_penalty 1.1": [(prompt(20), SamplingParams(
            max_tokens=8, repetition_penalty=1.1, ignore_eos=True))],
        "8 prompts of 5..700 tokens together": [(prompt(n, n), g) for n in
                                                (5, 9, 40, 77, 130, 260, 511, 700)],
        "32 prompts of 30 tokens, 16 new": [(prompt(30, i), SamplingParams(
            max_tokens=16, temperature=0.7, ignore_eos=True)) for i in range(32)],
    }
    for name, reqs in groups.items():
        lines.append(run_group(eng, name, reqs))
        print(lines[-1], flush=True)
    print("\n".join(line for line in lines if "compiles  0" not in line))
    print(f"variants after start-up: {len(EVENTS) - n_start}; their specialisations:")
    for spec in SPECS[n_start:]:
        print("   ", spec)


if __name__ == "__main__":
    main()
