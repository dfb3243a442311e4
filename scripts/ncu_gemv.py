"""One FP8 and one bf16 batch-1 GEMV per llama-3-8b shape, eager, for Nsight Compute:

    ncu --kernel-name regex:_gemv_kernel --section SpeedOfLight --section WarpStateStats \
        python3 scripts/ncu_gemv.py [--shapes gate_up,o_proj]

(each launch is preceded by a 512 MB write so the weight is not in L2). Not a benchmark by
itself: the numbers come from ncu.
"""

from __future__ import annotations

import argparse

import torch

from kiln.runtime.kernels import gemv

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 14336),
          "gate_up": (28672, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gate_up,o_proj")
    ap.add_argument("--dtypes", default="fp8,bf16")
    args = ap.parse_args()
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        x = torch.randn(1, k * 2, device="cuda", dtype=torch.bfloat16)
        for dt in args.dtypes.split(","):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            s = None
            if dt == "fp8":
                w, s = (w * 64).to(torch.float8_e4m3fn), torch.tensor(1 / 64, device="cuda")
            for _ in range(2):
                flush.zero_()
                gemv.gemv(x[:, :k], w, s)
            torch.cuda.synchronize()
            print(name, dt, "config", gemv.default_config(1, n, k, dt == "fp8"), flush=True)


if __name__ == "__main__":
    main()
