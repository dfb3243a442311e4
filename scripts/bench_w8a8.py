"""Experiment: why the W8A8 gemv (quantize_input) streams at ~1.1 TB/s at M = 1 on the H200.

    PYTHONPATH=. python3 scripts/bench_w8a8.py

Per llama-3-8b linear at M = 1 (and 8): W8A16 gemv (default config) vs W8A8 variants of the
same kernel: x quantized in the K loop (as shipped), the same with x's next tile prefetched a
step ahead, and x already e4m3 (QUANT=3: the pure FP8 tensor-core dot, the ceiling of a
kernel whose producer writes e4m3), each over a few tile configs; fp8_linear (quant kernel +
_scaled_mm) for reference. bench_gemv.time_us timing (CUDA graph, weights cycled past L2).
"""

from __future__ import annotations

import itertools

import torch
import triton
from bench_gemv import Shape, time_us  # scripts/ is on sys.path when run as a script

from kiln.runtime.kernels import gemv as g
from kiln.runtime.kernels.fp8_quant import quantize_fp8_padded
from kiln.runtime.layers.linear import fp8_linear

SHAPES = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 28672),
          ("down", 14336, 4096)]
CONFIGS = [g._cfg(64, 128, True, stages=4), g._cfg(128, 128, True, stages=4),
           g._cfg(128, 256, True, warps=8, stages=3)]


def launch(x, w, ws, xs, cfg, quant: int, prefetch: bool) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(k, bk)))
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    g._gemv_kernel[(triton.cdiv(n, bn), split)](
        x, w, ws, y, y, part, xs, m, n, k, k_split, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=True, EVEN_K=k == split * k_split,
        SPLIT=split > 1, HAS_SCALE=True, HAS_BIAS=False, WIDEN=False, ACT=False, QUANT=quant,
        K_POW2=1, PREFETCH=prefetch, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        g._splitk_reduce_kernel[(triton.cdiv(n, block), m)](
            part, ws, y, y, xs, m, n, y.stride(0), SPLIT_K=split, HAS_SCALE=True,
            HAS_BIAS=False, QUANT=True, BLOCK=block, num_warps=4)
    return y


def main() -> None:
    rows = []
    for (name, k, n), m in itertools.product(SHAPES, (1, 8)):
        s = Shape(k, n)
        x = s.x(m)
        xs = s.input_scale.reshape(1)
        xq = quantize_fp8_padded(x, xs)[0][:m]
        ref = fp8_linear(x, s.q[0], s.scale, s.input_scale)
        gb = s.nbytes(m, 1) / 1e3
        res = {"W8A16 gemv": time_us(lambda i: g.gemv(x, s.q[i], s.scale), s.cq)["us"],
               "fp8_linear": time_us(lambda i: fp8_linear(x, s.q[i], s.scale, s.input_scale),
                                     s.cq)["us"]}
        for cfg, split in itertools.product(CONFIGS, (1, 2, 4)):
            c = dict(cfg, SPLIT_K=split)
            tag = f"{c['BLOCK_N']}x{c['BLOCK_K']}w{c['num_warps']}s{c['num_stages']}k{split}"
            for label, (quant, pre, xin) in {"in-loop": (1, False, x),
                                             "prefetch": (1, True, x),
                                             "x e4m3": (3, False, xq)}.items():
                try:
                    err = (launch(xin, s.q[0], s.scale, xs, c, quant, pre).float()
                           - ref.float()).norm() / ref.float().norm()
                    if err > 1e-2:
                        print(f"{name} M={m} {label} {tag}: rel err {err:.2e}", flush=True)
                        continue
                    us = time_us(lambda i, xin=xin, c=c, q=quant, p=pre: launch(
                        xin, s.q[i], s.scale, xs, c, q, p), s.cq, reps=8)["us"]
                except Exception as e:  # noqa: BLE001
                    print(f"{name} M={m} {label} {tag}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                best = res.get(label)
                if best is None or us < best[0]:
                    res[label] = (us, tag)
        rows.append((name, m, gb, res))
        del s
        torch.cuda.empty_cache()
    print("| layer | M | W8A16 gemv | fp8_linear | W8A8 in-loop | W8A8 prefetch | W8A8 x e4m3 |")
    print("|---|---|---|---|---|---|---|")
    for name, m, gb, r in rows:
        def f(v):
            if isinstance(v, tuple):
                return f"{v[0]:.1f} ({gb / v[0]:.2f}) {v[1]}"
            return f"{v:.1f} ({gb / v:.2f})"
        print(f"| {name} | {m} | {f(r['W8A16 gemv'])} | {f(r['fp8_linear'])} | "
              + " | ".join(f(r[k]) if k in r else "-" for k in ("in-loop", "prefetch", "x e4m3"))
              + " |", flush=True)


if __name__ == "__main__":
    main()
