"""Engine steps of a serving run, on the GPU: B requests of L random tokens decoding (the pure
decode step), then the same while K new L-token prompts arrive before every step (the mixed
step of an offline 1000/1000 run), each timed over 20 steps; then the mixed steps' CUDA
kernels under torch.profiler, by total time (kernels inside CUDA-graph replays included).

usage: python benchmarks/serving_step.py ENGINE_DIR [B=256] [L=1000] [K=4] [--decode-profile]
Prints ms per step (wall, the GPU synchronized at the end of each run of 20) and the kernel
table (name, calls, total ms, us per call). Programmatic dependent launch (KILN_PDL) lets a
kernel start before its predecessor ends: its time then includes that wait."""

from __future__ import annotations

import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

STEPS = 20
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def kernel_table(prof, steps: int, rows: int = 14) -> str:
    """The CUDA kernels of a profile by total time: calls and ms per step, us per call."""
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            t = totals.setdefault(e.name, [0, 0.0])
            t[0] += 1
            t[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    busy = sum(t[1] for t in totals.values())
    lines = [f"{'kernel':60s} {'calls/step':>10s} {'ms/step':>8s} {'us/call':>8s}"]
    for name, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"{name[:60]:60s} {n / steps:10.1f} {us / steps / 1000:8.2f} {us / n:8.1f}")
    lines.append(f"{'all kernels':60s} {'':10s} {busy / steps / 1000:8.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    args = [a for a in argv if not a.startswith("--")]
    engine_dir = args[0]
    b, length, k = (int(a) for a in args[1:] + ["256", "1000", "4"][len(args) - 1:])
    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig())
    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, 30000)
    # each request may produce L more tokens (a 1000/1000 run's shape): admission reserves KV
    # for prompt + max_tokens, so a long model context (131,072) must not be asked for here
    params = SamplingParams(max_tokens=max(1, min(engine.limits.max_seq_len - length, length)),
                            temperature=0, ignore_eos=True)

    def add(n: int) -> None:
        for _ in range(n):
            engine.add_request([rng.randrange(vocab) for _ in range(length)], params)

    def run(new_per_step: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(STEPS):
            add(new_per_step)
            engine.step()
        sync()
        return (time.perf_counter() - start) / STEPS * 1000

    room = engine.limits.max_batch_size - b
    if room < k:
        print(f"note: max_batch_size {engine.limits.max_batch_size} leaves room for {max(room, 0)} of "
              f"the {k} new prompts a step beside {b} running: the mixed step is mostly decodes; "
              f"build with --max-batch-size {b + 64 * k} or more to measure it")
    add(b)
    for _ in range(10_000):  # until every prompt is prefilled: all b requests sample a token
        if len(engine.step()) >= b:
            break
    for _ in range(5):
        engine.step()
    print(f"decode step, {b} running at ~{length} tokens of context: {run(0):.2f} ms")
    if "--decode-profile" in argv and torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(0)
        print(kernel_table(prof, STEPS))
    print(f"mixed step, {b}+ running, {k} new {length}-token prompts a step: {run(k):.2f} ms")
    if not torch.cuda.is_available():
        return
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(k)
    print(kernel_table(prof, STEPS))


if __name__ == "__main__":
    main(sys.argv[1:])
