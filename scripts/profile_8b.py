"""Where a llama-3-8b-shape step's time goes on the GPU (random weights; bf16 and FP8).

    PYTHONPATH=. python3 scripts/profile_8b.py [--only b1,fp8,tput] [--out r.json]

b1    bf16, batch 1: GPU time of one decode-bucket replay (CUDA events) vs the engine's wall
      time per decode step (the difference is host work), and the replay's kernels.
fp8   the same with FP8 weights.
tput  bf16, --requests x 512 in / 256 out greedy: wall time per step by step kind (graph
      replay or eager, with or without a prefill chunk), then the kernels and host time of a
      few mixed steps (torch.profiler, CPU + CUDA).
Benchmarks, not tests. Prints tables last; numbers go to --out as JSON.
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
from profile_step import replay_ms  # scripts/ is on sys.path when run as a script
from torch.profiler import ProfilerActivity, profile

from kiln.builder import QuantConfig, build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

LINES: list[str] = []


def say(s: str) -> None:
    print(s, flush=True)
    LINES.append(s)


def dev_us(e) -> float:
    for a in ("device_time_total", "cuda_time_total"):
        if hasattr(e, a):
            return float(getattr(e, a))
    return 0.0


def kernels(prof, per: int, top: int = 18) -> list[dict]:
    """Kernel rows of a profile, per step (``per`` steps profiled), by device time."""
    rows = [{"name": e.key[:70], "calls": e.count / per, "us": dev_us(e) / per}
            for e in prof.key_averages() if dev_us(e) > 0 and e.key[:4] != "cuda"]
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    say(f"    kernels per step: {sum(r['calls'] for r in rows):.0f} launches, "
        f"{total:.0f} us device time")
    for r in rows[:top]:
        say(f"    {r['us']:9.1f} us  {r['calls']:6.1f}x  {r['name']}")
    return rows


def build(tmp: Path, quant: str) -> Path:
    out = tmp / f"l3-{quant}"
    if not out.exists():
        build_engine("random:llama-3-8b", out, dtype="bfloat16", max_seq_len=2048,
                     max_num_tokens=8192, max_batch_size=256, progress=False,
                     quantization=QuantConfig(weights="fp8") if quant == "fp8" else None)
    return out


def timed_steps(eng: LLMEngine, prompt: list[int],
                params: SamplingParams) -> tuple[list[float], float]:
    """One request run to the end: (wall seconds of each engine step, total seconds)."""
    eng.add_request(prompt, params)
    steps = []
    torch.cuda.synchronize()
    t_all = time.perf_counter()
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return steps, time.perf_counter() - t_all


def batch1(res: dict, tmp: Path, quant: str) -> None:
    eng = LLMEngine.from_engine_dir(build(tmp, quant), RuntimeConfig(device="cuda"))
    runner = eng.runner.graphs
    b = next(b for b in runner.buckets if b.num_seqs == 1 and not b.masked)
    replay = replay_ms(runner, b, iters=30)  # leaves the dummy step staged for the profile
    g = runner.graphs[b]
    prompt = list(range(1000, 1128))
    p = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    r = res[f"b1-{quant}"] = {"replay_ms": replay}
    for mode in ("sync", "async"):
        eng.async_scheduling = mode == "async"
        steps, t_all = timed_steps(eng, prompt, p)
        wall = statistics.median(steps[1:]) * 1e3
        r[mode] = {"step_wall_ms": wall, "first_step_ms": steps[0] * 1e3,
                   "tok_s": 128 / t_all}
        say(f"llama-3-8b {quant} b1 [{mode}]: replay {replay:.3f} ms GPU, engine step "
            f"{wall:.3f} ms wall (host {wall - replay:.3f}), first step "
            f"{steps[0] * 1e3:.1f} ms, {128 / t_all:.1f} tok/s (128 new)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    r["kernels"] = kernels(prof, 5)
    del eng, g
    gc.collect()
    torch.cuda.empty_cache()


def throughput(res: dict, tmp: Path, n: int) -> None:
    eng = LLMEngine.from_engine_dir(build(tmp, "bf16"), RuntimeConfig(device="cuda"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (512,), generator=gen).tolist() for _ in range(n)]
    # warm-up: one full 8192-token eager step compiles the prefill kernels' configs
    eng.generate(prompts[:16], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    last: dict = {}
    execute = eng.runner.execute

    def recording_execute(batch, *a, **kw):
        last["batch"] = batch
        return execute(batch, *a, **kw)

    eng.runner.execute = recording_execute
    for k, mode in enumerate(("sync", "async")):
        eng.async_scheduling = mode == "async"
        # fresh prompts per run: the prefix cache would skip the second run's prefill
        fresh = [[(t + 7919 * (k + 1)) % 128000 for t in pr] for pr in prompts]
        one_run(eng, res, fresh, n, mode, last)
    del eng
    gc.collect()
    torch.cuda.empty_cache()


def one_run(eng: LLMEngine, res: dict, prompts: list, n: int, mode: str, last: dict) -> None:
    p = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    for pr in prompts:
        eng.add_request(pr, p)
    kinds: dict[str, list[float]] = defaultdict(list)
    runner = eng.runner.graphs
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    profiled = None
    step_no = 0
    while eng.has_unfinished_requests():
        running = len(eng.scheduler.running)
        waiting = len(eng.scheduler.waiting)
        before = runner.num_replays
        mixed_now = running >= 200 and waiting > 0 and step_no > 40
        if profiled is None and mixed_now:
            profiled = {"step": step_no}
            torch.cuda.synchronize()
            t = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    eng.step()
                torch.cuda.synchronize()
            profiled["wall_ms"] = (time.perf_counter() - t) / 3 * 1e3
            step_no += 3
            continue
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        step_no += 1
        graph = runner.num_replays > before
        items = last["batch"].items
        prefill = sum(n for _, n in items if n > 1)
        kinds[f"{'graph' if graph else 'eager'} seqs~{len(items) // 32 * 32}"
              f" prefill {'0' if not prefill else '<=512' if prefill <= 512 else '>512'}"
              ].append(dt * 1e3)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    out_tok = n * 256
    r = res[f"tput-{mode}"] = {
        "requests": n, "seconds": total, "output_tok_s": out_tok / total, "steps": step_no,
        "kinds": {k: {"n": len(v), "median_ms": statistics.median(v), "sum_s": sum(v) / 1e3}
                  for k, v in kinds.items()}}
    say(f"llama-3-8b bf16 {n} req 512/256 [{mode}]: {total:.1f} s, {out_tok / total:.0f} "
        f"output tok/s, {step_no} steps ({total / step_no * 1e3:.1f} ms/step)")
    for k, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1]["sum_s"]):
        say(f"    {k:40} {v['n']:5d} steps  median {v['median_ms']:7.2f} ms  "
            f"sum {v['sum_s']:6.2f} s")
    if profiled is not None:
        say(f"  profiled 3 mixed steps from step {profiled['step']}: "
            f"{profiled['wall_ms']:.1f} ms wall per step")
        r["profiled"] = profiled
        r["kernels"] = kernels(prof, 3, top=22)
        cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                     key=lambda e: -e.self_cpu_time_total)[:12]
        say("    host (self CPU time per step):")
        for e in cpu:
            say(f"    {e.self_cpu_time_total / 3 / 1e3:8.2f} ms  {e.count / 3:7.1f}x  "
                f"{e.key[:60]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="b1,fp8,tput")
    ap.add_argument("--requests", type=int, default=384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res: dict = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d")}
    tmp = Path(tempfile.mkdtemp())
    for part in args.only.split(","):
        try:
            {"b1": lambda: batch1(res, tmp, "bf16"), "fp8": lambda: batch1(res, tmp, "fp8"),
             "tput": lambda: throughput(res, tmp, args.requests)}[part]()
        except Exception:  # noqa: BLE001 - report and go on
            import traceback
            res.setdefault("errors", {})[part] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    print("\n" + "\n".join(LINES))


if __name__ == "__main__":
    main()
