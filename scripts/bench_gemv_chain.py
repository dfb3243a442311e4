"""The batch-1 GEMVs of a whole llama-3-8b decode step, alone, as the step runs them: 32
layers x (qkv, o_proj, gate_up, down with the SiLU prologue) + the bf16 lm_head, distinct
weights (7 GB FP8: nothing stays in L2), one CUDA graph, PDL on. Answers how much of the
FP8 step (2.75 ms replay) the GEMVs take by themselves, and which configs win *in the chain*
(under PDL a kernel's ramp overlaps the one before it, which the one-kernel sweep of
bench_gemv.py cannot see).

    PYTHONPATH=. python3 scripts/bench_gemv_chain.py [--bf16] [--sweep] [--budget-s 240]

Prints the chain's replay time and its effective TB/s for the shipped rules and each
variant (with --sweep, every CUDA-core config x split of one shape at a time, the others at
their defaults, then the best of each together), then a table. Benchmarks, not tests.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_gemv import time_us  # scripts/ is on sys.path as a script

from kiln.runtime.kernels import _pdl, gemv

DEV = "cuda"
LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
ROWS: list[str] = []
# wider tiles than GEMV_CONFIGS has (more weight bytes per K step)
EXTRA = [gemv._cfg(32, 256, False), gemv._cfg(32, 512, False, warps=8),
         gemv._cfg(16, 512, False, warps=8), gemv._cfg(64, 256, False, warps=8)]


def make_weights(fp8: bool) -> tuple[list[dict], torch.Tensor]:
    layers = []
    for _ in range(LAYERS):
        layer = {}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k**-0.5
            if fp8:
                layer[name] = ((w * 64).to(torch.float8_e4m3fn),
                               torch.tensor(1 / 64, device=DEV))
            else:
                layer[name] = (w, None)
            del w
        layers.append(layer)
    lm_head = torch.randn(128256, 4096, device=DEV, dtype=torch.bfloat16) * 4096**-0.5
    return layers, lm_head


def chain(layers, lm_head, x, gu, configs: dict) -> torch.Tensor:
    for layer in layers:
        for name in ("qkv", "o_proj", "gate_up"):
            w, s = layer[name]
            gemv.gemv(x, w, s, config=configs.get(name))
        w, s = layer["down"]
        gemv.gemv(gu, w, s, config=configs.get("down"), silu_and_mul=True)
    return gemv.gemv(x, lm_head)


def time_chain(layers, lm_head, x, gu, configs: dict) -> float:
    """Median ms per chain, 16 chains back to back in one CUDA graph (bench_gemv.time_us)."""
    return time_us(lambda _: chain(layers, lm_head, x, gu, configs), copies=1, reps=10)["us"] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16", action="store_true", help="bf16 weights instead of FP8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    fp8 = not args.bf16
    layers, lm_head = make_weights(fp8)
    x = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    gu = torch.randn(1, 2 * 14336, device=DEV, dtype=torch.bfloat16)
    nbytes = sum(w.numel() * w.element_size() for layer in layers for w, _ in layer.values())
    nbytes += lm_head.numel() * 2
    res = {"card": torch.cuda.get_device_name(), "fp8": fp8, "pdl": _pdl.mode(),
           "bytes": nbytes, "variants": {}}

    def record(label: str, configs: dict, **knobs) -> float:
        old = {k: getattr(gemv, k) for k in knobs}
        for k, v in knobs.items():
            setattr(gemv, k, v)
        try:
            ms = time_chain(layers, lm_head, x, gu, configs)
        finally:
            for k, v in old.items():
                setattr(gemv, k, v)
        res["variants"][label] = {"ms": ms, "configs": configs, "knobs": knobs}
        ROWS.append(f"| {label} | {ms:.3f} | {nbytes / ms / 1e9:.2f} |")
        print(ROWS[-1], flush=True)
        return ms

    defaults = {name: gemv.default_config(1, n, k, fp8) for name, (n, k) in SHAPES.items()}
    base = record("shipped rules", {})
    if args.sweep:
        best = {}
        for name, (n, k) in SHAPES.items():  # an equal share of the budget per shape
            t0 = time.perf_counter()
            best[name] = (base, defaults[name])
            cands = [dict(cfg, SPLIT_K=sp) for cfg in gemv.GEMV_CONFIGS + EXTRA
                     if not cfg["USE_DOT"] for sp in gemv.split_candidates(n, k, cfg)]
            for c in cands:
                if time.perf_counter() - t0 > args.budget_s / len(SHAPES):
                    print(f"{name}: budget spent", flush=True)
                    break
                label = (f"{name} {c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} "
                         f"split {c['SPLIT_K']}")
                try:
                    ms = record(label, {name: c})
                except Exception as e:  # noqa: BLE001 - a config that does not fit
                    print(f"{label}: {type(e).__name__}: {e}", flush=True)
                    continue
                if ms < best[name][0]:
                    best[name] = (ms, c)
        combo = {name: b[1] for name, b in best.items()}
        res["best"] = {name: {"ms": b[0], "config": b[1]} for name, b in best.items()}
        record("best configs together", combo)
    print(f"\n{res['card']}, {'FP8' if fp8 else 'bf16'} weights, {nbytes / 1e9:.2f} GB, "
          f"PDL mode {res['pdl']}")
    print("| variant | chain ms | TB/s |\n|---|---|---|")
    for r in ROWS:
        print(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
