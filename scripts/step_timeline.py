"""What the GPU does between two batch-1 decode graphs, step by step (async scheduling).

Profiles a window of engine steps mid-request (torch.profiler, CUDA activity) and splits the
GPU timeline at each step's sampling kernel. Per step: the graph's span (first
kernel start -> last graph kernel end), and every GPU op from that end to the next graph's
first kernel, with its start offset and duration: what stands between two graphs on the
device. Prints one sample boundary in full and the medians.

    PYTHONPATH=.:scripts python3 scripts/step_timeline.py [--only fp8,smol] [--temps 0,1]

A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from step_gap import profiled_steps  # scripts/ is on sys.path when run as a script

from kiln.builder.spec import QuantConfig
from kiln.builder.writer import build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

SAMPLE = "_sample_partial"  # the first sampling kernel, right after each graph


def _model_kernel(name: str) -> bool:  # the model's Triton kernels are all _named
    return name.startswith("_") and not name.startswith("_sample")


def engine_dir(tmp: Path, which: str) -> Path:
    out = tmp / which
    if which == "smol":
        build_engine("random:smollm2-135m", out, dtype="bfloat16", max_seq_len=2048,
                     max_num_tokens=8192, max_batch_size=64, progress=False)
    else:
        build_engine("random:llama-3-8b", out, dtype="bfloat16", max_seq_len=2048,
                     max_num_tokens=8192, max_batch_size=256, progress=False,
                     quantization=QuantConfig(weights="fp8", lm_head="fp8" if which ==
                                              "fp8-lmh" else "none")
                     if which.startswith("fp8") else None)
    return out


def analyse(ev: list, label: str) -> str:
    """Split at each sampling kernel: the graph ends with the last GEMV before it (the
    lm_head) and the next graph starts with the next model kernel after it."""
    anchors = [i for i, e in enumerate(ev) if e.name.startswith(SAMPLE)]
    spans, gaps, between = [], [], defaultdict(list)
    ends, starts = [], []
    for a in anchors:
        last = max((i for i in range(a) if ev[i].name.startswith("_gemv")), default=None)
        nxt = next((i for i in range(a, len(ev)) if _model_kernel(ev[i].name)), None)
        if last is None or nxt is None:
            continue
        ends.append(last)
        starts.append(nxt)
    sample = None
    for k, (last, nxt) in enumerate(zip(ends, starts)):
        g_end = ev[last].time_range.end
        gaps.append(ev[nxt].time_range.start - g_end)
        if k + 1 < len(ends):
            spans.append(ev[ends[k + 1]].time_range.end - ev[nxt].time_range.start)
        rows = []
        for e in ev[last + 1:nxt + 1]:
            rows.append((e.time_range.start - g_end, e.time_range.end - e.time_range.start,
                         e.name[:70]))
            if e is not ev[nxt]:
                between[e.name[:70]].append(e.time_range.end - e.time_range.start)
        if k == 2:
            sample = rows
    if not gaps:
        return f"== {label}: no graph boundary found ({len(ev)} GPU events)"
    nb = len(gaps)
    head = (f"== {label}: {nb} boundaries; graph span median "
            f"{statistics.median(spans) if spans else 0:.1f} us; graph end -> next graph start "
            f"median {statistics.median(gaps):.1f} us (min {min(gaps):.1f}, max {max(gaps):.1f})")
    out = [head]
    out.append("   ops between graphs (per boundary: count, mean us):")
    for name, v in sorted(between.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"     {len(v) / nb:4.1f}x {statistics.mean(v):6.1f} us  {name}")
    out.append("   one boundary in full (start offset from the graph's end, duration; the last "
               "row is the next graph's first kernel):")
    for t0, d, name in sample or []:
        out.append(f"     +{t0:7.1f}  {d:6.1f}  {name}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="fp8,smol")
    ap.add_argument("--temps", default="1,0")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    report = []
    for which in args.only.split(","):
        eng = LLMEngine.from_engine_dir(engine_dir(tmp, which), RuntimeConfig(device="cuda"))
        eng.generate([list(range(1000, 1128))],
                     SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        for t in args.temps.split(","):
            report.append(analyse(profiled_steps(eng, float(t), n=20, warm=20), f"{which} temperature {t}"))
            print(report[-1], flush=True)
        del eng
        torch.cuda.empty_cache()
    print("\n".join(report))


if __name__ == "__main__":
    main()
