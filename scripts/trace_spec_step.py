"""Where a speculative (lookahead) step's wall time goes: GPU busy vs host, per step.

    KILN_CACHE=... PYTHONPATH=. python3 scripts/trace_spec_step.py [--window 7,7,7]
        [--steps 20] [--out DIR] [--mid-m 0,1]

Builds smollm2-135m bf16 (the GGUF in $KILN_CACHE, else random weights) with a lookahead
engine, decodes one code prompt plainly and with lookahead, and profiles ``--steps`` engine
steps of each (torch.profiler, CPU + CUDA). Prints per mode: wall per step, device-busy time
per step (union of kernel and copy intervals), the host-only remainder, and the CPU ops with
the most self time; writes chrome traces to --out (open in chrome://tracing or Perfetto).
The question it answers: why a lookahead step costs more than its graph replay
(notes/NOTES.md, 2026-11-30 second session). Runs on CPU too (no device rows).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_fast_path import build_smol  # scripts/ is on sys.path
from torch.profiler import ProfilerActivity, profile

from kiln.bench.prompts import CODE_PROMPTS
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams


def busy_us(prof) -> float:
    """Union of device intervals (kernels, copies, memsets) in microseconds."""
    spans = []
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            start = e.time_range.start
            spans.append((start, start + e.time_range.elapsed_us()))
    spans.sort()
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", default="7,7,7")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--mid-m", default=None,
                    help="gemv.MID_M values to trace in turn (one engine each), e.g. 0,1: "
                    "why its faster replays made slower lookahead steps (NOTES.md)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    source, eng_dir = build_smol(Path(tempfile.mkdtemp()), max_batch_size=8, window=args.window,
                                 dtype="bfloat16" if cuda else "float32")
    from kiln.runtime.kernels import gemv

    window = tuple(int(x) for x in args.window.split(","))
    out_dir = Path(args.out) if args.out else None
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, {source}, window {window}")
    mids = [v == "1" for v in args.mid_m.split(",")] if args.mid_m else [gemv.MID_M]
    shipped = gemv.MID_M
    for mid in mids:
        gemv.MID_M = mid  # before the engine captures its graphs
        try:
            eng = LLMEngine.from_engine_dir(eng_dir,
                                            RuntimeConfig(device="cuda" if cuda else "cpu"))
            trace(eng, window, args.steps, cuda, out_dir, f"MID_M={int(mid)} ")
            del eng
        finally:
            gemv.MID_M = shipped


def trace(eng, window, steps: int, cuda: bool, out_dir: Path | None, label: str) -> None:
    """Profile ``steps`` steady engine steps, plain then lookahead, on one code prompt."""
    prompt = eng.apply_chat_template([{"role": "user", "content": CODE_PROMPTS[0]}])
    for name, lookahead in (("plain", (1, 1, 0)), ("lookahead", window)):
        p = SamplingParams(max_tokens=steps * 8 + 64, temperature=0, ignore_eos=True,
                           lookahead=lookahead)
        eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                              lookahead=lookahead))
        rid = eng.add_request(prompt, p)
        for _ in range(8):  # past the prefill, into steady decoding
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        produced = 0
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                for o in eng.step():
                    produced += len(o.new_token_ids)
            if cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / steps * 1e3
        eng.abort(rid)
        while eng.has_unfinished_requests():
            eng.step()
        busy = busy_us(prof) / steps / 1e3
        print(f"  {label}{name:9} wall {wall:.3f} ms/step, device busy {busy:.3f} ms/step, "
              f"host-only {wall - busy:.3f} ms/step, {produced / steps:.2f} tokens/step "
              f"-> {produced / steps / wall * 1e3:.0f} tok/s")
        cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                     key=lambda e: -e.self_cpu_time_total)[:10]
        for e in cpu:
            print(f"      {e.self_cpu_time_total / steps:9.1f} us/step  "
                  f"{e.count / steps:6.1f}x  {e.key[:70]}")
        if cuda:  # the kernels (and copies) that ran, by device time
            dev = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                         key=lambda e: -e.self_device_time_total)[:8]
            for e in dev:
                print(f"      {e.self_device_time_total / steps:9.1f} us/step  "
                      f"{e.count / steps:6.1f}x  [device] {e.key[:60]}")
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out_dir / f"trace_{label.strip()}_{name}.json"))


if __name__ == "__main__":
    main()
