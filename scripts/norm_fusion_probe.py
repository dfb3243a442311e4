"""Where the residual + RMSNorm fusion loses at llama-3-8b shapes: the batch-1 GEMVs of a
whole step with each form of the norm, alone (32 layers of distinct FP8 weights, one CUDA
graph, PDL on), and which side of the fusion costs what:

  A  o_proj, fused_add_rms_norm, gate_up; down, fused_add_rms_norm, qkv   (shipped at 8B)
  B  producer RES_EPI=1 (+ residual, partials), consumer PRENORM=1 (normalised loads)
  C  producer RES_EPI=2 (+ h * g), consumer PRENORM=2 (1 / rms in the epilogue)
  D  producer RES_EPI=2, consumer plain GEMV (no statistics read)
  E  producer plain, consumer PRENORM=2 (partials of another layer: timing only)
  F  producer RES_EPI=1, consumer plain
  G  producer plain, norm kernel, consumer plain, but the producer's config from RES_EPI

Also prints every compiled GEMV variant's registers and spills as the GPU compiled them.

    PYTHONPATH=.:scripts python3 scripts/norm_fusion_probe.py

A benchmark, not a test.
"""

from __future__ import annotations

import torch
from bench_gemv import time_us  # scripts/ is on sys.path

from kiln.runtime.kernels import gemv
from kiln.runtime.kernels.rms_norm import fused_add_rms_norm

DEV = "cuda"
LAYERS = 32
BF16 = torch.bfloat16


def weights():
    def fp8(n, k):
        w = torch.randn(n, k, device=DEV, dtype=BF16) * k**-0.5
        return (w * 64).to(torch.float8_e4m3fn), torch.tensor([1 / 64], device=DEV)

    return [{"qkv": fp8(6144, 4096), "o": fp8(4096, 4096), "gu": fp8(28672, 4096),
             "down": fp8(4096, 14336), "g1": (torch.rand(4096, device=DEV) + 0.5).to(BF16),
             "g2": (torch.rand(4096, device=DEV) + 0.5).to(BF16)} for _ in range(LAYERS)]


def main() -> None:
    import os

    torch.manual_seed(0)
    layers = weights()
    attn = torch.randn(1, 4096, device=DEV, dtype=BF16)
    res = torch.randn(1, 4096, device=DEV, dtype=BF16)
    ss_stale = torch.rand(512, device=DEV)

    def pair(mode, x, wa, silu, g, wb):
        """One producer -> (norm) -> consumer transition in the given form."""
        (qa, sa), (qb, sb) = wa, wb
        if mode == "A":
            y = gemv.gemv(x, qa, sa, silu_and_mul=silu)
            xn, _ = fused_add_rms_norm(y, res, g, 1e-5)
            return gemv.gemv(xn, qb, sb)
        if mode == "B":
            h, ss = gemv.gemv_add_residual(x, qa, sa, None, res, silu_and_mul=silu)
            return gemv.gemv_prenormed(h, ss, g, 1e-5, qb, sb)
        if mode == "C":
            h, hg, ss = gemv.gemv_add_residual_weighted(x, qa, sa, None, res, g,
                                                        silu_and_mul=silu)
            return gemv.gemv_rms_scaled(hg, ss, 1e-5, qb, sb)
        if mode == "D":
            h, hg, ss = gemv.gemv_add_residual_weighted(x, qa, sa, None, res, g,
                                                        silu_and_mul=silu)
            return gemv.gemv(hg, qb, sb)
        if mode == "E":
            y = gemv.gemv(x, qa, sa, silu_and_mul=silu)
            return gemv.gemv_rms_scaled(y, ss_stale, 1e-5, qb, sb)
        if mode == "F":
            h, ss = gemv.gemv_add_residual(x, qa, sa, None, res, silu_and_mul=silu)
            return gemv.gemv(h, qb, sb)
        raise ValueError(mode)

    def step(mode):
        def run(_):
            x = attn
            for L in layers:
                gu = pair(mode, x, L["o"], False, L["g1"], L["gu"])
                pair(mode, gu, L["down"], True, L["g2"], L["qkv"])
        return run

    rows = []
    for mode in os.environ.get("MODES", "ABCDEFAC"):
        ms = time_us(step(mode), copies=1, reps=8)["us"] / 1e3
        rows.append(f"| {mode} | {ms:.3f} |")
        print(rows[-1], flush=True)

    print("\ncompiled _gemv_kernel variants: registers, spills, warps, then the last "
          "constexprs (RES_EPI, PRENORM, NPART_PAD)")
    for cache in getattr(gemv._gemv_kernel, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for key, k in kernels.items():
            regs = getattr(k, "n_regs", None)
            spills = getattr(k, "n_spills", None)
            warps = getattr(getattr(k, "metadata", None), "num_warps", None)
            consts = [v for t, v in key[1] if t == "constexpr"][-3:] if isinstance(
                key, tuple) and len(key) > 1 else str(key)[-120:]
            print(f"  regs {regs} spills {spills} warps {warps} tail {consts}")
    print(f"\n{torch.cuda.get_device_name()}, llama-3-8b FP8 GEMVs + norms of a step "
          "(no lm_head, no attention)")
    print("| form | ms |\n|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
