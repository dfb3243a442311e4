"""Microbenchmark: batch-1/8 decode linears on CUDA, F.linear vs gemv vs the FP8 paths.

Usage (on the GPU machine):
    PYTHONPATH=. python3 scripts/bench_gemv.py --warm-only          # compile in parallel
    PYTHONPATH=. python3 scripts/bench_gemv.py --sweep --out r.json # time (+ sweep configs)

Variants per shape (K -> N) and M in {1, 2, 4, 8} (the FP8 W8A8 variants at M = 1 and 8):
  F.linear bf16 | gemv bf16 | gemv fp8 (W8A16) | fp8_linear old (eager quant + pad +
  _scaled_mm, the code before the fused quant) | fp8_linear new (fused quant kernel), both
  with a static input scale, plus their dynamic-scale versions in the JSON.
Timing: each variant's calls over rotating weight copies (>= 256 MB touched, so L2 holds
nothing: HBM numbers) are captured in one CUDA graph and replayed (device time, no launch
overhead, as in a graph-captured decode step); CUDA events; median of the replays divided
by the calls. GB/s counts weights + x + y once; the H200 copy ceiling is 4.23 TB/s.
``--sweep`` also times every GEMV_CONFIGS entry x split_candidates (M = 1, 2, 8, 4, those
that fit in registers) and reports the best per shape. Prints a table last; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [  # (model, layer, K, N)
    ("llama-3-8b", "qkv", 4096, 6144), ("llama-3-8b", "o_proj", 4096, 4096),
    ("llama-3-8b", "gate_up", 4096, 28672), ("llama-3-8b", "down", 14336, 4096),
    ("llama-3-8b", "lm_head", 4096, 128256),
    ("smollm2-135m", "qkv", 576, 960), ("smollm2-135m", "o_proj", 576, 576),
    ("smollm2-135m", "gate_up", 576, 3072), ("smollm2-135m", "down", 1536, 576),
    ("smollm2-135m", "lm_head", 576, 49152),
]
DEV = "cuda"
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
TOUCH = 256e6  # bytes of weights cycled through per timing (> 4x the 60 MB L2)
SWEEP_M = (1, 2, 8, 4)  # in this order while the sweep budget lasts


def _regs(cfg: dict, m: int) -> float:
    """float32 accumulator registers per thread of a CUDA-core config at M rows."""
    if cfg["USE_DOT"]:
        return 0.0
    return cfg["BLOCK_N"] * m * cfg["BLOCK_K"] / (32 * cfg["num_warps"])


def sweep_configs(m: int, n: int, k: int) -> list[dict]:
    from kiln.runtime.kernels.gemv import GEMV_CONFIGS, split_candidates

    out = []
    for c in GEMV_CONFIGS:
        if _regs(c, m) > 128:  # would spill
            continue
        out += [dict(c, SPLIT_K=s) for s in split_candidates(n, k, c)]
    return out


def all_jobs(sweep: bool) -> list[tuple]:
    """(m, n, k, weight kind, bias, config or None) of every gemv launch this script and
    tests/gpu/test_gemv_gpu.py make (for --warm-only)."""
    from kiln.runtime.kernels.gemv import default_config

    jobs = []
    for _, _, k, n in SHAPES:
        for m in (1, 2, 3, 4, 8):
            for kind in ("bf16", "fp8", "fp16"):
                for bias in (False, True):
                    jobs.append((m, n, k, kind, bias, default_config(m, n, k, kind == "fp8")))
        if sweep:
            for m in SWEEP_M:
                for kind in ("bf16", "fp8"):
                    jobs += [(m, n, k, kind, False, c) for c in sweep_configs(m, n, k)]
    return list(dict.fromkeys((j[:5] + (json.dumps(j[5], sort_keys=True),)) for j in jobs))


def _warm_worker(jobs: list[tuple]) -> int:
    from kiln.runtime.kernels.gemv import gemv

    dtypes = {"bf16": BF16, "fp16": torch.float16, "fp8": FP8}
    done = 0
    for m, n, k, kind, bias, cfg in jobs:
        xd = torch.float16 if kind == "fp16" else BF16
        w = torch.empty(n, k, device=DEV, dtype=dtypes[kind])
        s = torch.ones((), device=DEV) if kind == "fp8" else None
        b = torch.zeros(n, device=DEV, dtype=xd) if bias else None
        try:
            gemv(torch.zeros(m, k, device=DEV, dtype=xd), w, s, b, config=json.loads(cfg))
            done += 1
        except Exception as e:  # noqa: BLE001 - report and go on; the timing run says more
            print(f"warm failed {m}x{n}x{k} {kind} {cfg}: {type(e).__name__}: {e}", flush=True)
    torch.cuda.synchronize()
    return done


def warm(sweep: bool, procs: int) -> None:
    """Compile every kernel variant in ``procs`` processes (triton's disk cache keeps them)."""
    jobs = all_jobs(sweep)
    t = time.perf_counter()
    chunks = [jobs[i::procs] for i in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        done = sum(pool.map(_warm_worker, chunks))
    print(f"warm: {done}/{len(jobs)} launches compiled/ran in {time.perf_counter() - t:.1f} s "
          f"with {procs} processes", flush=True)


# ---- timing ------------------------------------------------------------------------------


def time_us(fn, copies: int, reps: int = 12) -> dict:
    """µs per call of fn(i), i cycling over ``copies``: one CUDA graph of the calls,
    replayed; median (and min) over ``reps`` replays."""
    n = copies * max(1, -(-16 // copies))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(copies, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i % copies)
    g.replay()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    del g
    return {"us": statistics.median(times), "min_us": min(times)}


def fp8_linear_old(x, weight, weight_scale, input_scale=None):
    """kiln's fp8_linear CUDA path before the fused quant kernel (eager quant + pad)."""
    from kiln.runtime.layers.linear import fp8_scale, quantize_fp8

    m = x.shape[0]
    x_scale = fp8_scale(x) if input_scale is None else input_scale.float()
    xq = quantize_fp8(x, x_scale)
    pad = -m % 16
    if pad:
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale.reshape(()),
                            scale_b=weight_scale.float().reshape(()), out_dtype=x.dtype)[:m]


class Shape:
    """Weight copies (bf16 and FP8) of one K -> N linear, enough to cycle past L2."""

    def __init__(self, k: int, n: int):
        from kiln.builder.fp8 import quantize_per_tensor

        self.k, self.n = k, n
        w = torch.randn(n, k, device=DEV) * k**-0.5
        q, self.scale = quantize_per_tensor(w)
        self.w = [w.to(BF16)]
        self.q = [q]
        self.cw = max(1, min(512, int(-(-TOUCH // (n * k * 2)))))
        self.cq = max(1, min(512, int(-(-TOUCH // (n * k)))))
        self.w += [self.w[0].clone() for _ in range(self.cw - 1)]
        self.q += [q.clone() for _ in range(self.cq - 1)]
        self.input_scale = torch.tensor(0.02, device=DEV)

    def x(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.k, device=DEV).to(BF16)

    def nbytes(self, m: int, elem: int) -> int:
        return self.n * self.k * elem + (m * self.k + m * self.n) * 2


def variants(s: Shape, m: int) -> dict:
    """name -> (fn(i), copies, weight bytes per element)."""
    from kiln.runtime.kernels.gemv import gemv
    from kiln.runtime.layers.linear import fp8_linear

    x = s.x(m)
    xs = s.input_scale
    return {
        "F.linear bf16": (lambda i: F.linear(x, s.w[i]), s.cw, 2),
        "gemv bf16": (lambda i: gemv(x, s.w[i]), s.cw, 2),
        "gemv fp8": (lambda i: gemv(x, s.q[i], s.scale), s.cq, 1),
        "fp8_linear old": (lambda i: fp8_linear_old(x, s.q[i], s.scale, xs), s.cq, 1),
        "fp8_linear new": (lambda i: fp8_linear(x, s.q[i], s.scale, xs), s.cq, 1),
        "fp8_linear old dyn": (lambda i: fp8_linear_old(x, s.q[i], s.scale), s.cq, 1),
        "fp8_linear new dyn": (lambda i: fp8_linear(x, s.q[i], s.scale), s.cq, 1),
    }


def check(s: Shape, m: int) -> dict:
    """Relative errors of gemv (bf16, fp8) and of new vs old fp8_linear (should be 0)."""
    from kiln.runtime.kernels.gemv import gemv, gemv_ref
    from kiln.runtime.kernels.testing import rel_err
    from kiln.runtime.layers.linear import fp8_linear

    x = s.x(m)
    return {
        "gemv_bf16_rel_err": rel_err(gemv(x, s.w[0]), gemv_ref(x, s.w[0])),
        "gemv_fp8_rel_err": rel_err(gemv(x, s.q[0], s.scale), gemv_ref(x, s.q[0], s.scale)),
        "fp8_linear_new_equals_old": bool(torch.equal(
            fp8_linear(x, s.q[0], s.scale, s.input_scale),
            fp8_linear_old(x, s.q[0], s.scale, s.input_scale))),
    }


def run(args) -> dict:
    from kiln.runtime.kernels.gemv import default_config, gemv

    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "sms": props.multi_processor_count,
              "torch": torch.__version__, "rows": [], "sweep": []}
    import triton

    result["triton"] = triton.__version__
    t_start = time.perf_counter()
    shapes = {}
    for model, layer, k, n in SHAPES:
        s = Shape(k, n)
        for m in (1, 2, 4, 8):
            row = {"model": model, "layer": layer, "K": k, "N": n, "M": m,
                   "default_bf16": default_config(m, n, k, False),
                   "default_fp8": default_config(m, n, k, True)}
            vs = variants(s, m)
            names = list(vs) if m in (1, 8) else ["F.linear bf16", "gemv bf16", "gemv fp8",
                                                  "fp8_linear new"]
            for name in names:
                fn, copies, elem = vs[name]
                try:
                    r = time_us(fn, copies)
                    r["GBps"] = s.nbytes(m, elem) / (r["us"] * 1e-6) / 1e9
                except Exception as e:  # noqa: BLE001 - keep the other numbers
                    r = {"error": f"{type(e).__name__}: {e}"[:300]}
                row[name] = r
            if m == 1:  # the same version twice: the noise floor
                row["gemv bf16 (again)"] = time_us(vs["gemv bf16"][0], vs["gemv bf16"][1])
            try:
                row.update(check(s, m))
            except Exception as e:  # noqa: BLE001
                row["check_error"] = f"{type(e).__name__}: {e}"[:300]
            result["rows"].append(row)
            print(json.dumps(row), file=args.log, flush=True)
        shapes[(k, n)] = s if args.sweep else None
        if not args.sweep:
            del s
            torch.cuda.empty_cache()
    print(f"timing: {time.perf_counter() - t_start:.1f} s", flush=True)

    if args.sweep:
        t0 = time.perf_counter()
        order = [(m, kind, sh) for m in SWEEP_M for kind in ("bf16", "fp8") for sh in SHAPES]
        for m, kind, (model, layer, k, n) in order:
            if time.perf_counter() - t0 > args.sweep_budget_s:
                print(f"sweep budget spent; skipped {m} {kind} {model} {layer}", flush=True)
                continue
            s = shapes[(k, n)]
            x = s.x(m)
            ws, copies, elem = (s.w, s.cw, 2) if kind == "bf16" else (s.q, s.cq, 1)
            scale = s.scale if kind == "fp8" else None
            entry = {"model": model, "layer": layer, "K": k, "N": n, "M": m, "weight": kind,
                     "results": []}
            for cfg in sweep_configs(m, n, k):
                try:
                    r = time_us(lambda i, c=cfg, x=x, ws=ws, sc=scale: gemv(
                        x, ws[i], sc, config=c), copies, reps=8)
                    entry["results"].append({"config": cfg, "us": r["us"],
                                             "GBps": s.nbytes(m, elem) / (r["us"] * 1e-6) / 1e9})
                except Exception as e:  # noqa: BLE001
                    entry["results"].append({"config": cfg, "error": str(e)[:200]})
            ok = [r for r in entry["results"] if "us" in r]
            if ok:
                best = min(ok, key=lambda r: r["us"])
                entry["best"] = best
                print(f"sweep M={m} {kind} {model} {layer}: best {best['us']:.2f} us "
                      f"{best['GBps']:.0f} GB/s {json.dumps(best['config'])}", file=args.log,
                      flush=True)
            result["sweep"].append(entry)
        print(f"sweep: {time.perf_counter() - t0:.1f} s", flush=True)
    return result


def _fmt(r: dict | None) -> str:
    if not r:
        return "-"
    if "error" in r:
        return "ERR"
    return f"{r['us']:7.1f} ({r['GBps'] / 1e3:4.2f})"


def table(result: dict) -> str:
    best = {(e["K"], e["N"], e["M"], e["weight"]): e.get("best") for e in result["sweep"]}
    lines = [(f"{result['device']}, torch {result['torch']}, triton {result['triton']}: "
              "µs per call (TB/s) in a CUDA graph, weights cycled past L2"),
             ("| model | layer | M | F.linear bf16 | gemv bf16 | best bf16 | gemv fp8 | best fp8 "
              "| fp8_linear old | fp8_linear new | old dyn | new dyn |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        bb = best.get((r["K"], r["N"], r["M"], "bf16"))
        bf = best.get((r["K"], r["N"], r["M"], "fp8"))
        lines.append(
            f"| {r['model']} | {r['layer']} {r['K']}->{r['N']} | {r['M']} | "
            f"{_fmt(r.get('F.linear bf16'))} | {_fmt(r.get('gemv bf16'))} | {_fmt(bb)} | "
            f"{_fmt(r.get('gemv fp8'))} | {_fmt(bf)} | {_fmt(r.get('fp8_linear old'))} | "
            f"{_fmt(r.get('fp8_linear new'))} | {_fmt(r.get('fp8_linear old dyn'))} | "
            f"{_fmt(r.get('fp8_linear new dyn'))} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write all numbers as JSON here")
    ap.add_argument("--sweep", action="store_true", help="also time every candidate config")
    ap.add_argument("--sweep-budget-s", type=float, default=120.0)
    ap.add_argument("--warm-only", action="store_true",
                    help="compile every kernel variant in parallel processes, then exit")
    ap.add_argument("--procs", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--log", help="per-row JSON and sweep lines go here (default: stdout)")
    args = ap.parse_args()
    args.log = open(args.log, "w") if args.log else sys.stdout  # noqa: SIM115
    if args.warm_only:
        warm(True, args.procs)
        return
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result), flush=True)


if __name__ == "__main__":
    main()
