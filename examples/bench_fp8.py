"""FP8 vs bf16 on a CUDA GPU: the linear layers alone, then decode tokens/s of whole engines.

    PYTHONPATH=. python examples/bench_fp8.py [--preset llama-3-8b] [--out result.json]

1. Linear microbenchmark at the Llama-3-8B MLP shapes (N x K = 14336 x 4096 and
   4096 x 14336), M = 1 and 64 rows: F.linear in bf16 vs kiln's fp8_linear (static and
   dynamic activation scale) vs the bare torch._scaled_mm, plus the FP8 error vs bf16.
2. Engines built from ``random:<preset>`` in one process: bf16, FP8 weights (bf16 KV cache)
   and FP8 weights + FP8 KV cache; decode tokens/s at batch 1 and 64 (prefill-only time
   subtracted). kiln's runtime is still the plain-torch reference (one attention call per
   sequence per layer), so absolute numbers are low; the ratios are the point.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.artifact.spec import QuantConfig
from kiln.artifact.weights import quantize_per_tensor
from kiln.builder import build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.layers.linear import FP8, fp8_linear, fp8_scale, quantize_fp8
from kiln.runtime.sampling_params import SamplingParams

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def cuda_us(fn, iters: int = 200, warmup: int = 20) -> float:
    if DEV != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000


def linear_bench(shapes: tuple[tuple[int, int], ...]) -> list[dict]:
    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        q, s = quantize_per_tensor(w)
        for m in (1, 64):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            xs = fp8_scale(x)
            xq = quantize_fp8(x, xs)
            xq16 = torch.zeros(max(16, m), k, device=DEV, dtype=torch.uint8)
            xq16[:m] = xq.view(torch.uint8)
            xq16 = xq16.view(FP8)
            ref = F.linear(x, w).float()
            y = fp8_linear(x, q, s, xs).float()
            # the CPU/fallback arithmetic on the same inputs: _scaled_mm must agree with it
            emul = (xq.float() * xs) @ (q.float() * s).T
            row = {
                "N": n, "K": k, "M": m,
                "bf16_linear_us": cuda_us(lambda: F.linear(x, w)),
                "fp8_scaled_mm_us": cuda_us(lambda: torch._scaled_mm(
                    xq16, q.t(), scale_a=xs, scale_b=s, out_dtype=torch.bfloat16,
                )) if DEV == "cuda" else float("nan"),
                "fp8_linear_static_us": cuda_us(lambda: fp8_linear(x, q, s, xs)),
                "fp8_linear_dynamic_us": cuda_us(lambda: fp8_linear(x, q, s)),
                "fp8_vs_bf16_rel_err": float((y - ref).norm() / ref.norm()),
                "scaled_mm_vs_emulation_rel_err": float((y - emul).norm() / emul.norm()),
            }
            row["speedup_scaled_mm"] = row["bf16_linear_us"] / row["fp8_scaled_mm_us"]
            row["speedup_fp8_linear_static"] = row["bf16_linear_us"] / row["fp8_linear_static_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del w, q
    return rows


def decode_bench(path: Path, batch: int, prompt_len: int = 32, gen: int = 32) -> dict:
    engine = LLMEngine.from_engine_dir(path, RuntimeConfig(
        device=DEV, num_kv_blocks=512, enable_prefix_caching=False,
        attention_backend="torch"))
    prompts = [[(i * 31 + j * 7) % 250 + 1 for j in range(prompt_len)] for i in range(batch)]

    def run(max_tokens: int) -> float:
        sync()
        t = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True))
        sync()
        assert all(len(o.token_ids) == max_tokens for o in outs)
        return time.perf_counter() - t

    run(4)  # warm-up
    prefill = run(1)
    total = run(gen + 1)
    result = {"batch": batch, "prompt_len": prompt_len, "decode_tokens": batch * gen,
              "prefill_s": prefill, "total_s": total,
              "decode_tok_s": batch * gen / (total - prefill), "kv_dtype": str(engine.cache.k.dtype)}
    del engine
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-engines", action="store_true")
    args = ap.parse_args()
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)"
    print("device", name, "torch", torch.__version__, flush=True)
    shapes = ((14336, 4096), (4096, 14336)) if DEV == "cuda" else ((64, 32),)
    report = {"device": name, "torch": torch.__version__, "linear": linear_bench(shapes),
              "engines": {}}
    if not args.skip_engines:
        tmp = Path(tempfile.mkdtemp())
        variants = {
            "bf16": QuantConfig(),
            "fp8": QuantConfig("fp8", "fp8"),
            "fp8+kv_fp8": QuantConfig("fp8", "fp8", "fp8"),
        }
        for name, quant in variants.items():
            build_engine(f"random:{args.preset}", tmp / name, dtype="bfloat16",
                         quantization=quant, progress=False)
            report["engines"][name] = []
            for batch in (1, 64):
                r = decode_bench(tmp / name, batch)
                report["engines"][name].append(r)
                print(name, json.dumps(r), flush=True)
        for batch_i, batch in enumerate((1, 64)):
            base = report["engines"]["bf16"][batch_i]["decode_tok_s"]
            for name in ("fp8", "fp8+kv_fp8"):
                ratio = report["engines"][name][batch_i]["decode_tok_s"] / base
                print(f"batch {batch}: {name} / bf16 decode tokens/s = {ratio:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
