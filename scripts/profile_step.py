"""Where a fast-path step's time goes on the GPU (smollm2-135m bf16, batch 1 unless told).

    KILN_CACHE=... PYTHONPATH=. python3 scripts/profile_step.py [--out r.json]

1. GPU time of one graph replay per bucket (CUDA events, median of 50) vs the engine's wall
   time per decode step: the difference is host work (scheduling, staging, sampling, detok).
2. The kernels of one batch-1 decode replay (torch.profiler), by total time.
3. Lookahead windows within the engine's (7,7,7) on the code and chat prompts: tokens/step,
   speed-up over plain decoding (same engine, same run).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kiln.bench.prompts import CHAT_PROMPTS
from kiln.bench.speculative import run_speculative_latency
from kiln.builder import build_engine
from kiln.builder.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.sources.builtin import BUILTINS, cached_path


def replay_ms(runner, bucket, iters: int = 50) -> float:
    """Median GPU ms of a bucket's replay on the dummy step (left staged for a profile)."""
    return runner.replay_ms(bucket, iters)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--windows", default="7,7,7;5,5,5;7,4,7;4,4,4;5,3,5;3,3,3;7,3,7")
    args = ap.parse_args()
    res: dict = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    gguf = cached_path(BUILTINS["smollm2-135m"])
    source = "smollm2-135m" if gguf.is_file() else "random:smollm2-135m"
    out = Path(tempfile.mkdtemp()) / "smol"
    build_engine(source, out, dtype="bfloat16", max_seq_len=1024, max_num_tokens=4096,
                 max_batch_size=64, progress=False,
                 speculative=SpeculativeConfig.from_cli("lookahead", "7,7,7", None, None))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cuda"))
    runner = eng.runner.graphs
    rows = []
    for b in sorted(runner.graphs, key=lambda b: (b.masked, b.num_tokens)):
        if b.num_seqs in (1, 8, 64):
            ms = replay_ms(runner, b)
            rows.append((f"replay S={b.num_seqs} T={b.num_tokens} masked={b.masked}", ms))
    prompt = eng.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[0]}])
    p = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True, lookahead=(1, 1, 0))
    eng.generate([prompt], p)
    torch.cuda.synchronize()
    t = time.perf_counter()
    o = eng.generate([prompt], p)[0]
    dt = time.perf_counter() - t
    rows.append(("engine wall per decode step (b1)", dt / o.metrics.num_steps * 1e3))
    res["timings_ms"] = dict(rows)

    from torch.profiler import ProfilerActivity, profile

    b1 = next(b for b in runner.graphs if b.num_seqs == 1 and not b.masked)
    runner.stager.fill_dummy(b1.num_seqs, b1.num_tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            runner.graphs[b1].replay()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    res["kernels_b1"] = table

    spec = {}
    if source == "smollm2-135m":
        for w in args.windows.split(";"):
            win = tuple(int(x) for x in w.split(","))
            r = run_speculative_latency(eng, output_len=256, prompts_per_set=3, window=win)
            spec[w] = {k: {kk: s[kk] for kk in ("plain_tokens_per_s", "spec_tokens_per_s",
                                                "speedup", "tokens_per_step")}
                       for k, s in r["sets"].items()}
    res["lookahead_windows"] = spec
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(table)
    print(f"\n{res['card']} {res['date']} smollm2-135m bf16 ({source})")
    for name, ms in rows:
        print(f"  {name:45} {ms:8.3f} ms")
    for w, sets in spec.items():
        print(f"  lookahead ({w}): " + "; ".join(
            f"{k} x{s['speedup']:.2f} ({s['tokens_per_step']:.2f} tok/step, "
            f"{s['plain_tokens_per_s']:.0f} -> {s['spec_tokens_per_s']:.0f})"
            for k, s in sets.items()))


if __name__ == "__main__":
    main()
