"""Probe: can o_proj's weights stream into shared memory while attention runs?

Issue 6, FP8 >= 400 tok/s at batch 1. Per llama-3-8b layer the HBM sits nearly idle for
~6 us (rotary + KV write, attention, its split reduce: latency-bound kernels), and then
o_proj streams its 16.8 MB (~6 us cold). Pulling o_proj's weights into L2 during attention
did not pay (eighth session: even L2-hot, the Triton GEMV takes 5 us). This probe asks
whether a GEMV whose CTAs become resident under PDL *during* the previous kernel, copy
their whole weight slice into shared memory before ``griddepcontrol.wait``
(``cp.async.bulk`` with an mbarrier per warp: no register holds it), and after the wait
only read x and do the arithmetic, makes o_proj's share of the chain small.

The chain per layer, 32 layers with distinct (HBM-cold) weights, one CUDA graph:
``stand-in attention`` (a PDL kernel: waits, lets the next kernel launch, then spins for
``--spin-us`` on 128 CTAs holding ``--att-smem`` KB of shared memory, as attention's
CTAs do) -> ``o_proj`` (variant) -> ``gate_up`` (kiln's Triton GEMV, so that o_proj's
successor also overlaps as in the step). o_proj's cost = chain - the chain without it.

    PYTHONPATH=.:scripts python3 scripts/preload_probe.py [--spin-us 0,4]

Variants: ``triton`` (kiln's shipped GEMV: PDL, first two tiles L2-hinted before the wait)
and ``smem:R:W`` (CUDA, R rows per CTA in R * 4096 bytes of shared memory, W warps). Checks
each CUDA variant's output against the Triton GEMV first. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import ctypes

import torch
from bench_gemv import time_us  # scripts/ is on sys.path
from cuda_gemv_probe import SOURCE, _LaunchAttr, _LaunchConfig, _libcuda

from kiln.runtime.kernels import gemv

DEV = "cuda"
LAYERS = 32
HELPERS = SOURCE[:SOURCE.index('extern "C"')]
KERNELS = HELPERS + r"""
#ifndef ROWS
#define ROWS 8
#define NWARPS 4
#endif
extern "C" __global__ void standin(int* sink, long long spin) {
    extern __shared__ unsigned char att_smem[];
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {}
    if (threadIdx.x == 0 && blockIdx.x == 0) sink[0] = (int)att_smem[0] * 0 + 1;
}

// A CTA owns ROWS consecutive rows of W [N, K] (one contiguous ROWS * K-byte range); warp w
// owns rows [w * RW, (w + 1) * RW), copied by its lane 0 into shared memory behind its own
// mbarrier before the PDL wait. After the wait: x from global, W from shared memory.
extern "C" __global__ void __launch_bounds__(NWARPS * 32)
gemv_smem(const bf16_t* __restrict__ x, const unsigned char* __restrict__ w,
          const float* __restrict__ scale, bf16_t* __restrict__ y, int N, int K) {
    extern __shared__ __align__(128) unsigned char sw[];
    __shared__ __align__(8) unsigned long long bar[NWARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int RW = ROWS / NWARPS;
    const int row0 = blockIdx.x * ROWS + warp * RW;
    const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[warp]);
    unsigned char* mine = sw + (size_t)warp * RW * K;
    if (lane == 0) {
        const unsigned bytes = (unsigned)(RW * K);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b) : "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(b), "r"(bytes) : "memory");
        const unsigned char* src = w + (size_t)row0 * K;
        const unsigned dst = (unsigned)__cvta_generic_to_shared(mine);
        for (unsigned off = 0; off < bytes; off += 16384u) {
            const unsigned n = min(16384u, bytes - off);
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                         " [%0], [%1], %2, [%3];"
                         :: "r"(dst + off), "l"(src + off), "r"(n), "r"(b) : "memory");
        }
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    __syncwarp();
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;"
                     " selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(b) : "memory");
    float acc[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) acc[r] = 0.0f;
    for (int s = 0; s < K; s += 512) {
        float xf[16];
        load_x16(x, s + lane * 16, K, xf);
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            const uint4 v = *reinterpret_cast<const uint4*>(mine + (size_t)r * K + s + lane * 16);
            acc[r] = dot16(v, xf, acc[r]);
        }
    }
    const float sc = *scale;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        const float a = warp_sum(acc[r]);
        if (lane == 0) y[row0 + r] = f2bf(a * sc);
    }
}
"""


class Kernel:
    """One NVRTC-compiled kernel of KERNELS, launched with cuLaunchKernelEx (PDL attribute)."""

    def __init__(self, name: str, smem: int, threads: int, **defines):
        opts = [f"-D{k}={v}" for k, v in {"ACT": 0, "AHEAD": 1, "ROWS_W": 1, "PDL": 1,
                                          **defines}.items()]
        self.k = torch.cuda._compile_kernel(KERNELS, name, nvcc_options=opts)
        self.smem, self.threads = smem, threads
        if smem > 48 << 10:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            rc = _libcuda().cuFuncSetAttribute(self.k.func, 8, smem)
            if rc:
                raise RuntimeError(f"cuFuncSetAttribute({smem}) failed: {rc}")
        self.attr = _LaunchAttr()
        self.attr.id = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self.attr.value[0] = 1

    def launch(self, grid: int, args: list) -> None:
        held = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else a
                for a in args]
        argv = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
                                               for a in held])
        cfg = _LaunchConfig(grid, 1, 1, self.threads, 1, 1, self.smem,
                            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                            ctypes.pointer(self.attr), 1)
        rc = _libcuda().cuLaunchKernelEx(ctypes.byref(cfg), self.k.func,
                                         argv, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernelEx failed: {rc}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin-us", default="0,4")
    ap.add_argument("--att-smem", type=int, default=64, help="KB per stand-in CTA")
    ap.add_argument("--variants", default="smem:32:8,smem:16:4,smem:16:8,smem:8:4")
    args = ap.parse_args()
    torch.manual_seed(0)
    clock_ghz = 1.98
    n, k, n_gu = 4096, 4096, 28672
    xs = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    sink = torch.zeros(4, device=DEV, dtype=torch.int32)
    scale = torch.tensor([1 / 64], device=DEV)
    o_w = [(torch.randn(n, k, device=DEV) * k**-0.5 * 64).to(torch.float8_e4m3fn)
           for _ in range(LAYERS)]
    gu_w = [(torch.randn(n_gu, k, device=DEV) * k**-0.5 * 64).to(torch.float8_e4m3fn)
            for _ in range(LAYERS)]
    y = torch.empty(1, n, device=DEV, dtype=torch.bfloat16)

    stand = Kernel("standin", args.att_smem << 10, 128)
    smem_k = {}
    for v in args.variants.split(","):
        _, rows, warps = v.split(":")
        rows, warps = int(rows), int(warps)
        smem_k[v] = (Kernel("gemv_smem", rows * k, warps * 32, ROWS=rows, NWARPS=warps), rows)

    ref = gemv.gemv(xs, o_w[0], scale).float()
    scale_ref = ref.abs().max().item()
    for v, (kern, rows) in smem_k.items():
        y.zero_()
        kern.launch(n // rows, [xs, o_w[0], scale, y, ctypes.c_int(n), ctypes.c_int(k)])
        torch.cuda.synchronize()
        err = (y.float() - ref).abs().max().item() / scale_ref
        print(f"{v}: max err vs Triton GEMV {err:.2e} (of the output max)", flush=True)
        assert err < 2e-2, v

    def o_proj(v: str, i: int) -> None:
        if v == "triton":
            gemv.gemv(xs, o_w[i], scale)
        elif v != "none":
            kern, rows = smem_k[v]
            kern.launch(n // rows, [xs, o_w[i], scale, y, ctypes.c_int(n), ctypes.c_int(k)])

    rows_out = []
    for spin_us in (float(s) for s in args.spin_us.split(",")):
        spin = ctypes.c_longlong(int(spin_us * 1e3 * clock_ghz))

        def chain(v: str, spin=spin):
            def run(_):
                for i in range(LAYERS):
                    stand.launch(128, [sink, spin])
                    o_proj(v, i)
                    gemv.gemv(xs, gu_w[i], scale)
            return time_us(run, copies=1, reps=8)["us"] / LAYERS

        base = chain("none")
        for v in ["triton", *smem_k, "triton"]:
            t = chain(v)
            rows_out.append(f"| {spin_us:g} | {v} | {t:.2f} | {t - base:.2f} |")
            print(rows_out[-1], flush=True)
        rows_out.append(f"| {spin_us:g} | (no o_proj) | {base:.2f} | 0 |")
    print(f"\n{torch.cuda.get_device_name()}; us per layer (stand-in attention -> o_proj -> "
          f"gate_up), 32 layers, cold weights; stand-in CTAs hold {args.att_smem} KB")
    print("| spin us | o_proj | us per layer | o_proj's share |\n|---|---|---|---|")
    for r in rows_out:
        print(r)


if __name__ == "__main__":
    main()
