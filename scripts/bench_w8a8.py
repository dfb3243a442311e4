"""FP8 small-batch linears on the H200: fp8_linear through _scaled_mm vs through the Triton
W8A8 gemv (both after the same fused activation-quant kernel), and the W8A16 gemv.

    PYTHONPATH=. python3 scripts/bench_w8a8.py

Per llama-3-8b layer shape and M in {1, 2, 4, 8}, static input scale: µs per call (TB/s of
weight + x + y bytes) in bench_gemv's harness (CUDA graph of calls over weight copies cycled
past L2; median of replays). Prints a table last, and the per-decode-step sum (32 layers).
"""

from __future__ import annotations

import contextlib

import torch
from bench_gemv import Shape, time_us  # scripts/ is on sys.path when run as a script

from kiln.runtime.kernels import gemv as g
from kiln.runtime.layers.linear import fp8_linear

SHAPES = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 28672),
          ("down", 14336, 4096)]
VARIANTS = ("W8A16 gemv", "fp8_linear _scaled_mm", "fp8_linear W8A8 gemv")


@contextlib.contextmanager
def w8a8_everywhere(on: bool):
    """fp8_linear takes the Triton W8A8 GEMM at every shape (on) or _scaled_mm (off)."""
    real = g.w8a8_wins
    g.w8a8_wins = lambda m, n, k: on
    try:
        yield
    finally:
        g.w8a8_wins = real


def measure(s: Shape, m: int) -> tuple[dict, float]:
    """µs per call of each variant at M = m, and the W8A8 vs _scaled_mm relative error."""
    x = s.x(m)
    res = {"W8A16 gemv": time_us(lambda i: g.gemv(x, s.q[i], s.scale), s.cq)["us"]}
    out = {}
    for name, on in (("fp8_linear _scaled_mm", False), ("fp8_linear W8A8 gemv", True)):
        with w8a8_everywhere(on):
            res[name] = time_us(
                lambda i: fp8_linear(x, s.q[i], s.scale, s.input_scale), s.cq)["us"]
            out[on] = fp8_linear(x, s.q[0], s.scale, s.input_scale).float()
    return res, float((out[True] - out[False]).norm() / out[False].norm())


def main() -> None:
    rows = []
    for name, k, n in SHAPES:
        s = Shape(k, n)
        for m in (1, 2, 4, 8):
            res, err = measure(s, m)
            rows.append((name, m, s.nbytes(m, 1), res, err))
        del s
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: µs per call (TB/s)")
    print("| layer | M | " + " | ".join(VARIANTS) + " | W8A8 vs _scaled_mm rel err |")
    print("|---|---|" + "---|" * (len(VARIANTS) + 1))
    for name, m, nbytes, r, err in rows:
        cells = " | ".join(f"{r[v]:.1f} ({nbytes / r[v] / 1e6:.2f})" for v in VARIANTS)
        print(f"| {name} | {m} | {cells} | {err:.1e} |")
    for m in (1, 2, 4, 8):
        tot = {v: 32 * sum(r[v] for _, mm, _, r, _ in rows if mm == m) for v in VARIANTS}
        print(f"M={m}: 32 layers, " + ", ".join(f"{v} {t:.0f} us" for v, t in tot.items()))


if __name__ == "__main__":
    main()
