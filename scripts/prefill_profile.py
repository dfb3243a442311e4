"""The GPU kernels of one 128-token prefill step of an 8B engine (the TTFT of `kiln bench
latency`): torch.profiler over the first engine step of a request, kernels by total time.

    PYTHONPATH=.:scripts python3 scripts/prefill_profile.py [--quant fp8] [--lm-head fp8]

A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from step_gap import cuda_events  # scripts/ is on sys.path when run as a script
from torch.profiler import ProfilerActivity, profile

from kiln.builder import QuantConfig, build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="fp8")
    ap.add_argument("--lm-head", default="none")
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "l3"
    build_engine("random:llama-3-8b", path, dtype="bfloat16", max_seq_len=2048,
                 max_num_tokens=8192, max_batch_size=256, progress=False,
                 quantization=QuantConfig(weights=args.quant if args.quant == "fp8" else "none",
                                          lm_head=args.lm_head))
    eng = LLMEngine.from_engine_dir(path, RuntimeConfig(device="cuda"))
    prompt = [1000 + i for i in range(args.prompt_len)]
    p = SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True)
    for _ in range(3):
        eng.generate([prompt], p)
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        eng.add_request(prompt, p)
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        while eng.has_unfinished_requests():
            eng.step()
    eng.add_request(prompt, p)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    while eng.has_unfinished_requests():
        eng.step()
    ev = cuda_events(prof)
    by = defaultdict(list)
    for e in ev:
        by[e.name[:80]].append(e.time_range.end - e.time_range.start)
    span = ev[-1].time_range.end - ev[0].time_range.start
    busy = sum(sum(v) for v in by.values())
    print(f"first step wall ms: {', '.join(f'{w:.2f}' for w in walls)}")
    print(f"profiled step: GPU span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
          f"{len(ev)} ops")
    for name, v in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:14]:
        print(f"  {sum(v) / 1e3:7.3f} ms  {len(v):4d}x  {name}")


if __name__ == "__main__":
    main()
