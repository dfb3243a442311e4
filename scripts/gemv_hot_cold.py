"""Is a batch-1 GEMV of llama-3-8b bound by HBM or by its own latency? Each shape timed with
its weight L2-resident ("hot": one weight, the same call back to back in one CUDA graph;
H200 L2 is 50 MB, so qkv 25 MB and o_proj 17 MB FP8 stay there) against distinct weights
("cold": enough copies to pass 400 MB per graph), FP8 and bf16, PDL on, a few CUDA-core
configs each. Hot close to cold means the kernel's own latency, not HBM, sets its time.

    PYTHONPATH=.:scripts python3 scripts/gemv_hot_cold.py [--dtypes fp8] [--knob ATTR=V1,V2]
        [--configs default]

``--knob`` A/Bs an integer rule of the gemv module; every row reports its relative error
against gemv_ref (float32).

Benchmarks, not tests; prints a table last.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from bench_gemv import time_us  # scripts/ is on sys.path as a script

from kiln.runtime.kernels import gemv

DEV = "cuda"
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 14336),
          "gate_up": (28672, 4096), "lm_head": (128256, 4096)}
CONFIGS = [None, gemv._cfg(16, 256, False), gemv._cfg(8, 512, False),
           gemv._cfg(4, 1024, False, warps=8), gemv._cfg(16, 1024, False, warps=8),
           gemv._cfg(32, 256, False), gemv._cfg(16, 512, False), gemv._cfg(8, 1024, False, warps=8),
           gemv._cfg(32, 512, False, warps=8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="fp8,bf16")
    ap.add_argument("--knob", default=None, metavar="ATTR=V1,V2",
                    help="an integer rule of the gemv module to A/B, e.g. MAXNREG=0,64")
    ap.add_argument("--configs", default="all", help="all, or default")
    ap.add_argument("--shapes", default="qkv,o_proj,down,gate_up",
                    help=f"comma-separated, of {list(SHAPES)}")
    args = ap.parse_args()
    configs = CONFIGS if args.configs == "all" else [None]
    rows = []
    x = torch.randn(1, 14336 * 2, device=DEV, dtype=torch.bfloat16)
    for fp8 in [d == "fp8" for d in args.dtypes.split(",")]:
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            nbytes = n * k * (1 if fp8 else 2)
            copies = max(2, -(-400_000_000 // nbytes))
            ws = []
            for _ in range(copies):
                w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k**-0.5
                ws.append((w * 64).to(torch.float8_e4m3fn) if fp8 else w)
            s = torch.tensor(1 / 64, device=DEV) if fp8 else None
            xi = x[:, :k]
            ref = gemv.gemv_ref(xi, ws[0], s).float()
            attr, _, raw = (args.knob or "").partition("=")
            values = [int(v) for v in raw.split(",")] if attr else [None]
            shipped = getattr(gemv, attr) if attr else None
            for cfg, value in itertools.product(configs, values):
                if attr:
                    setattr(gemv, attr, value)
                label = "default" if cfg is None else f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']}w{cfg['num_warps']}"
                label += f" {attr}={value}" if attr else ""
                try:
                    err = (gemv.gemv(xi, ws[0], s, config=cfg).float() - ref).norm() / ref.norm()
                    def call(i, ws=ws, xi=xi, s=s, cfg=cfg, hot=False):
                        return gemv.gemv(xi, ws[0 if hot else i], s, config=cfg)

                    hot = time_us(lambda i, call=call: call(i, hot=True), 1)["us"]
                    cold = time_us(call, copies)["us"]
                except Exception as e:  # noqa: BLE001 - report and go on
                    rows.append(f"| {'fp8' if fp8 else 'bf16'} {name} | {label} | error {e} |")
                    continue
                rows.append(f"| {'fp8' if fp8 else 'bf16'} {name} ({nbytes / 1e6:.1f} MB) | "
                            f"{label} | hot {hot:.2f} us ({nbytes / hot / 1e6:.2f} TB/s) | "
                            f"cold {cold:.2f} us ({nbytes / cold / 1e6:.2f} TB/s) | "
                            f"rel err {err:.2e} |")
                print(rows[-1], flush=True)
            if attr:
                setattr(gemv, attr, shipped)
            del ws
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
