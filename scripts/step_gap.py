"""Where a batch-1 decode step's time goes besides its CUDA graph (llama-3-8b shape, random
weights, bf16 and FP8): the graph replay alone (CUDA events) against whole engine steps under
async scheduling, greedy and sampled (temperature 1, as `kiln bench latency`), each with the
sampling kernels (kiln/runtime/kernels/sampling.py) and with torch's ops, and the GPU
kernels that run outside the graph (torch.profiler over a few steps: busy time, idle time,
the kernels that are not the model's Triton kernels).

    PYTHONPATH=.:scripts python3 scripts/step_gap.py [--only fp8,bf16] [--out r.json]

A benchmark, not a test. Prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from profile_8b import build, timed_steps  # scripts/ is on sys.path when run as a script
from torch.profiler import ProfilerActivity, profile

from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.layers import sampler
from kiln.runtime.sampling_params import SamplingParams

PROMPT = list(range(1000, 1128))


def steps_ms(eng: LLMEngine, params: SamplingParams,
             prompt: list[int] = PROMPT) -> tuple[float, float]:
    """(median wall ms per step after the first 8, output tokens per second) of one request."""
    times, total = timed_steps(eng, prompt, params)
    return statistics.median(times[8:]) * 1e3, params.max_tokens / total


def cuda_events(prof) -> list:
    """A torch.profiler run's GPU events, by start time."""
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ev.sort(key=lambda e: e.time_range.start)
    return ev


def profiled_steps(eng: LLMEngine, temperature: float, n: int, warm: int = 12,
                   prompt: list[int] = PROMPT) -> list:
    """The GPU events of ``n`` engine steps of one request after ``warm`` steps (the request
    then runs to its end)."""
    eng.add_request(prompt, SamplingParams(max_tokens=n + warm + 40, temperature=temperature,
                                           ignore_eos=True))
    for _ in range(warm):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            eng.step()
        torch.cuda.synchronize()
    while eng.has_unfinished_requests():
        eng.step()
    return cuda_events(prof)


def outside_kernels(eng: LLMEngine, params: SamplingParams, n: int = 24) -> dict:
    """Profile ``n`` engine steps mid-request: per step, the GPU's busy and idle time and the
    kernels that are not Triton kernels of the model (sampling, copies, clones)."""
    ev = profiled_steps(eng, params.temperature, n)
    if not ev:
        return {"busy_us": 0.0, "idle_us": 0.0, "span_us": 0.0, "kernels_per_step": 0.0,
                "outside": []}
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    span = ev[-1].time_range.end - ev[0].time_range.start
    other: dict[str, list[float]] = defaultdict(list)
    for e in ev:
        if not e.name.startswith("_") or e.name.startswith("_sample"):  # the model's
            # Triton kernels are all _named; the sampling kernels run after the graph
            other[e.name[:60]].append(e.time_range.end - e.time_range.start)
    return {"busy_us": busy / n, "idle_us": (span - busy) / n, "span_us": span / n,
            "kernels_per_step": len(ev) / n,
            "outside": sorted(((k, len(v) / n, sum(v) / n) for k, v in other.items()),
                              key=lambda r: -r[2])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="fp8,bf16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    res: dict = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    rows = []
    for quant in args.only.split(","):
        eng = LLMEngine.from_engine_dir(build(tmp, quant), RuntimeConfig(device="cuda"))
        g = eng.runner.graphs
        b = next(b for b in g.buckets if b.num_seqs == 1 and not b.masked)
        replay = statistics.median(g.replay_ms(b, iters=30) for _ in range(3))
        eng.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        r = res[quant] = {"replay_ms": replay}
        for name, t, kernels in (("greedy", 0.0, False), ("t1", 1.0, False),
                                 ("greedy", 0.0, True), ("t1", 1.0, True)):
            sampler.KERNELS = kernels
            name = f"{name} {'kernels' if kernels else 'torch'}"
            p = SamplingParams(max_tokens=128, temperature=t, ignore_eos=True)
            r[name] = [steps_ms(eng, p) for _ in range(3)]
            r[f"{name}_profile"] = outside_kernels(eng, p)
            ms = statistics.median(x[0] for x in r[name])
            tok = statistics.median(x[1] for x in r[name])
            pr = r[f"{name}_profile"]
            rows.append(f"| {quant} | {name} | {replay:.3f} | {ms:.3f} | {ms - replay:.3f} | "
                        f"{tok:.1f} | {pr['busy_us']:.0f} / {pr['idle_us']:.0f} | "
                        f"{pr['kernels_per_step']:.0f} |")
            print(f"{quant} {name}: kernels outside the graph per step:", flush=True)
            for k, calls, us in pr["outside"][:12]:
                print(f"    {us:7.1f} us  {calls:4.1f}x  {k}", flush=True)
        del eng, g
        gc.collect()
        torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"\n{res['card']} {res['date']}: batch-1 decode, 128-token prompt, async scheduling")
    print("| weights | sampling | replay ms | engine step ms | step - replay | tok/s (128 new) "
          "| GPU busy / idle us per step (profiled) | kernels per step |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
