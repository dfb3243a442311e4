"""Where an engine's start-up time goes: per-bucket CUDA-graph capture (first forward, second
forward, capture) and a cProfile of the whole ``LLMEngine.from_engine_dir``.

    python scripts/profile_startup.py ENGINE_DIR [--out stats.txt] [--no-profile]

Run it twice on the same TRITON_CACHE_DIR to compare a cold start with a warm one; the Triton
cache entries before and after are counted, so a start that compiled nothing shows 0 new.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from kiln.runtime import cuda_graph
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.kernel_cache import triton_cache_dir


def _entries(d: Path) -> int:
    return sum(1 for p in d.iterdir() if p.is_dir()) if d.is_dir() else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine")
    ap.add_argument("--out", default=None, help="write the full cProfile listing here")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()

    rows: list[dict] = []
    fwd = cuda_graph.CudaGraphRunner._forward
    cap = cuda_graph.CudaGraphRunner._capture_one

    def timed_forward(self, b):
        if torch.cuda.is_current_stream_capturing():
            return fwd(self, b)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fwd(self, b)
        torch.cuda.synchronize()
        rows[-1]["fwd_ms"].append(round((time.perf_counter() - t) * 1e3, 1))
        return out

    def timed_capture(self, b, stream):
        rows.append({"bucket": f"S{b.num_seqs}/T{b.num_tokens}{'m' if b.masked else ''}",
                     "fwd_ms": []})
        t = time.perf_counter()
        cap(self, b, stream)
        torch.cuda.synchronize()
        rows[-1]["total_ms"] = round((time.perf_counter() - t) * 1e3, 1)

    cuda_graph.CudaGraphRunner._forward = timed_forward
    cuda_graph.CudaGraphRunner._capture_one = timed_capture

    cache = triton_cache_dir()
    before = _entries(cache)
    torch.cuda.init()
    t0 = time.perf_counter()
    prof = None if args.no_profile else cProfile.Profile()
    if prof:
        prof.enable()
    eng = LLMEngine.from_engine_dir(args.engine, RuntimeConfig(device="cuda"))
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    print(json.dumps({"wall_s": round(wall, 2), "triton_cache": str(cache),
                      "entries_before": before, "entries_after": _entries(cache),
                      "kernels_installed": eng.kernels_installed,
                      "startup": {k: round(v, 2) for k, v in eng.startup_times.items()}}))
    for r in rows:
        print(f"{r['bucket']:>10}  forwards {r['fwd_ms']} ms  bucket total {r['total_ms']} ms")
    if prof:
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("cumulative").print_stats(45)
        st.sort_stats("tottime").print_stats(30)
        text = s.getvalue()
        if args.out:
            Path(args.out).write_text(text)
        print(text)


if __name__ == "__main__":
    main()
