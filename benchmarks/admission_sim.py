"""An offline throughput run (N requests of I prompt / O output tokens, all queued at once)
through kiln's own Scheduler and BlockManager, on the CPU, with each step's time from a cost
model: max(weights, tokens x GEMM cost) + KV tokens read x KV cost. It counts steps,
preemptions, recomputed tokens and the mean running batch, with the admission's KV
reservation on and off (``Scheduler(reserve=...)``).

usage: python benchmarks/admission_sim.py [POOL_TOKENS=456000] [BATCH=512] [BUDGET=16384]
                                          [N=768] [I=1000] [O=1000] [--fp8]
Defaults: llama-3-8b bf16 on an H100 80GB (a 456k-token KV pool; 5.5 ms of weights, 23 us of
GEMM per token, 128 KiB of KV per token at 2.2 TB/s); --fp8: FP8 weights and KV (2.7 ms,
12.3 us, 64 KiB). Step counts are the scheduler's own (this model's run of the measured bf16
1000/1000 at batch 512 took 3,020 steps, the GPU run 3,023); times are the model's."""

from __future__ import annotations

import sys

from kiln.runtime.kv_cache import BlockManager
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler

BLOCK = 16
COSTS = {  # weights ms, GEMM us per token, KV bytes per token, KV bytes/s
    "bf16": (5.5, 23.0, 131072, 2.2e12),
    "fp8": (2.7, 12.3, 65536, 2.2e12),
}


def simulate(pool_tokens: int, batch: int, budget: int, n: int, i: int, o: int,
             reserve: bool, costs: tuple = COSTS["bf16"]) -> dict:
    weights_ms, gemm_us, kv_bytes, kv_bw = costs
    sched = Scheduler(BlockManager(pool_tokens // BLOCK, BLOCK, enable_prefix_caching=False),
                      batch, budget, reserve=reserve)
    params = SamplingParams(max_tokens=o, ignore_eos=True)
    for k in range(n):
        sched.add(Request(str(k), [1 + (k * 7 + j) % 1000 for j in range(i)], params,
                          frozenset()))
    ms = 0.0
    steps = preemptions = recomputed = running = 0
    while sched.has_unfinished():
        batch_ = sched.schedule()
        steps += 1
        preemptions += len(batch_.preempted)
        recomputed += sum(m for r, m in batch_.items if m > 1 and r.output_token_ids)
        running += len(sched.running)
        kv_read = sum(r.num_computed_tokens + m for r, m in batch_.items)
        ms += (max(weights_ms, gemm_us * batch_.num_tokens / 1000)
               + kv_read * kv_bytes / kv_bw * 1000)
        sched.after_step(batch_)
        for r, _ in batch_.items:
            if r.num_computed_tokens == r.num_tokens:
                r.append_token(5)
                if len(r.output_token_ids) >= o:
                    r.finish("length")
                    sched.finish(r)
    return {"steps": steps, "model_s": round(ms / 1000, 1),
            "output_tok_s": round(n * o / ms * 1000), "preemptions": preemptions,
            "recomputed_tokens": recomputed, "mean_running": round(running / steps)}


def main(argv: list[str]) -> None:
    args = [int(a) for a in argv if not a.startswith("--")]
    pool, batch, budget, n, i, o = args + [456000, 512, 16384, 768, 1000, 1000][len(args):]
    costs = COSTS["fp8" if "--fp8" in argv else "bf16"]
    for reserve in (False, True):
        print(f"reserve={reserve!s:5}", simulate(pool, batch, budget, n, i, o, reserve, costs))


if __name__ == "__main__":
    main(sys.argv[1:])
