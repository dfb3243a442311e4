"""What an FP8 GEMM's scale form costs on the GPU: per-tensor weight scales (one per fused
tensor, what requantized q/k/v and gate/up shards get), against one scale per output row (what
per-channel checkpoints, and shards fused exactly with their own scales, get), at the
llama-3-8b shapes of the fused projections. Activations static (one scale) or per token.

usage: python benchmarks/fp8_gemm_scales.py [M ...]   (default 16 64 256 1024 4096 8192)

Rows: cuBLAS ``_scaled_mm`` with per-tensor scales; row-wise ``_scaled_mm`` (scale_a [M, 1],
scale_b [1, N]: per-token activations, or a static scale expanded per row); and kiln's
``fp8_gemm`` on a static activation scale with a per-row weight scale as it runs today. Times
are the best of two alternating rounds (A/B/A/B), us per call (CUDA-graph replays, median)."""

from __future__ import annotations

import sys

import torch

from kiln.runtime.kernels.tunable import time_cuda
from kiln.runtime.layers.linear import fp8_gemm, rowwise_weight_scale

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def time_us(fn) -> float:
    """us per call of ``fn()``: the kernel tuner's timer (CUDA-graph replays, median)."""
    return time_cuda(lambda i: fn(), torch.device("cuda")) * 1e6


def main(ms: list[int]) -> None:
    fp8, dev = torch.float8_e4m3fn, "cuda"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'gemm':8s} {'M':>5s} {'per-tensor':>11s} {'row-wise':>9s} {'ratio':>6s} "
          f"{'kiln static x, per-row w':>25s}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev).to(fp8)
        w_rows = torch.rand(n, device=dev) + 0.5
        scale_b = rowwise_weight_scale(w_rows, n)
        one = torch.ones((), device=dev)
        for m in ms:
            x = torch.randn(m, k, device=dev).to(fp8)
            scale_a = torch.ones(m, 1, device=dev)

            def tensor():
                return torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16)

            def rows():
                return torch._scaled_mm(x, w.t(), scale_a=scale_a, scale_b=scale_b,
                                        out_dtype=torch.bfloat16)

            def kiln_static():
                return fp8_gemm(x, one.reshape(1), m, w, w_rows, torch.bfloat16)

            t = [time_us(f) for f in (tensor, rows, kiln_static, tensor, rows, kiln_static)]
            a, b, c = min(t[0], t[3]), min(t[1], t[4]), min(t[2], t[5])
            print(f"{name:8s} {m:5d} {a:11.1f} {b:9.1f} {b / a:6.3f} {c:25.1f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [16, 64, 256, 1024, 4096, 8192])
