"""Probe: what the kernel boundaries of a batch-1 decode step cost, and what one persistent
kernel would win. The 128 FP8 GEMVs of an 8B step (32 x qkv, o_proj, gate_up, down; each
reading the previous one's output, so every boundary is a real all-to-all dependency) run:

  triton       kiln's Triton GEMV, one PDL kernel each (the shipped chain)
  cuda         the CUDA GEMV of cuda_gemv_probe.py (R4 U2, 4 warps), one PDL kernel each
  persistent   ONE kernel: every CTA resident, the same inner loop, a grid-wide barrier
               (an atomic counter) between GEMVs; ``+prefetch``: before waiting at a
               barrier each warp issues the next GEMV's first weight loads (weights do not
               depend on the barrier), so HBM stays busy across it (PDL cannot: the next
               kernel's CTAs are not resident while this one's run)

    PYTHONPATH=.:scripts python3 scripts/persistent_chain_probe.py

Checks the persistent chain's last output against the per-kernel CUDA chain's (the same
arithmetic per row: bit-equal expected), then times each form (one CUDA graph of 16 chains,
median of the replays). The barrier spins with a bound: a CTA that waits too long sets an
error flag and goes on (reported), so a co-residency mistake cannot hang the GPU. A
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import ctypes

import torch
from bench_gemv import time_us  # scripts/ is on sys.path
from cuda_gemv_probe import SOURCE, CudaGemv, _LaunchAttr, _LaunchConfig, _libcuda

from kiln.runtime.kernels import gemv

DEV = "cuda"
SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336)]

HELPERS = SOURCE[:SOURCE.index("__device__ __forceinline__ void load_x16")]
PERSISTENT = HELPERS + r"""
struct Op { const unsigned char* w; const bf16_t* x; bf16_t* y; int N; int K; int pad; };

__device__ __forceinline__ void load_x16_cg(const bf16_t* x, int k, float* xf) {
    // x is written inside this kernel: L2-coherent loads, not the read-only path
    const uint4* p = reinterpret_cast<const uint4*>(x + k);
    uint4 a = __ldcg(p), b = __ldcg(p + 1);
    unsigned v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        xf[2 * i] = __uint_as_float(v[i] << 16);
        xf[2 * i + 1] = __uint_as_float(v[i] & 0xFFFF0000u);
    }
}

__device__ __forceinline__ void first_loads(const Op& o, int grp, int lane, unsigned long long pol,
                                            uint4 (&buf)[AHEAD][ROWS_W]) {
    const int nsteps = o.K / 512;
#pragma unroll
    for (int u = 0; u < AHEAD; ++u)
#pragma unroll
        for (int r = 0; r < ROWS_W; ++r)
            if (u < nsteps)
                buf[u][r] = ldw(o.w + (size_t)min(grp * ROWS_W + r, o.N - 1) * o.K + u * 512
                                + lane * 16, pol);
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MIN_CTAS)
kiln_persistent_chain(const Op* __restrict__ ops, int nops, const float* __restrict__ scale,
                      unsigned int* counter, unsigned int* error) {
    const int lane = threadIdx.x & 31;
    const int gwarp = blockIdx.x * NWARPS + (threadIdx.x >> 5);
    const int nwarps = gridDim.x * NWARPS;
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    const float sc = *scale;
    uint4 buf[AHEAD][ROWS_W];
    bool preloaded = false;
#if PREFETCH_NEXT
    if (gwarp < (ops[0].N + ROWS_W - 1) / ROWS_W) { first_loads(ops[0], gwarp, lane, pol, buf); preloaded = true; }
#endif
    for (int op = 0; op < nops; ++op) {
        const Op o = ops[op];
        const int ngroups = (o.N + ROWS_W - 1) / ROWS_W;
        const int nsteps = o.K / 512;
        for (int grp = gwarp; grp < ngroups; grp += nwarps) {
            const int row0 = grp * ROWS_W;
            if (!preloaded) first_loads(o, grp, lane, pol, buf);
            preloaded = false;
            float acc[ROWS_W];
#pragma unroll
            for (int r = 0; r < ROWS_W; ++r) acc[r] = 0.0f;
            for (int s = 0; s < nsteps; s += AHEAD) {
#pragma unroll
                for (int u = 0; u < AHEAD; ++u) {
                    if (s + u < nsteps) {
                        float xf[16];
                        load_x16_cg(o.x, (s + u) * 512 + lane * 16, xf);
#pragma unroll
                        for (int r = 0; r < ROWS_W; ++r) {
                            uint4 v = buf[u][r];
                            if (s + u + AHEAD < nsteps)
                                buf[u][r] = ldw(o.w + (size_t)min(row0 + r, o.N - 1) * o.K
                                                + (s + u + AHEAD) * 512 + lane * 16, pol);
                            acc[r] = dot16(v, xf, acc[r]);
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS_W; ++r) {
                const float a = warp_sum(acc[r]);
                if (lane == 0 && row0 + r < o.N) o.y[row0 + r] = f2bf(a * sc);
            }
        }
        if (op + 1 < nops) {
#if PREFETCH_NEXT
            const Op nx = ops[op + 1];
            if (gwarp < (nx.N + ROWS_W - 1) / ROWS_W) { first_loads(nx, gwarp, lane, pol, buf); preloaded = true; }
#endif
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                atomicAdd(counter, 1u);
                const unsigned target = (unsigned)(op + 1) * gridDim.x;
                unsigned spins = 0;
                // bounded: after a timeout every later barrier is skipped too (the error
                // flag), so a CTA that is not resident cannot hang the GPU
                while (*((volatile unsigned*)counter) < target && !*((volatile unsigned*)error)) {
                    if (++spins > (1u << 22)) { atomicExch(error, 1u); break; }
                }
                __threadfence();
            }
            __syncthreads();
        }
    }
}
"""


class Persistent:
    def __init__(self, r: int, u: int, warps: int, per_sm: int, prefetch: bool):
        self.r, self.u, self.warps = r, u, warps
        opts = [f"-DROWS_W={r}", f"-DAHEAD={u}", f"-DNWARPS={warps}",
                f"-DPREFETCH_NEXT={int(prefetch)}", f"-DMIN_CTAS={per_sm}"]
        self.kernel = torch.cuda._compile_kernel(PERSISTENT, "kiln_persistent_chain",
                                                 nvcc_options=opts)
        n = ctypes.c_int(0)
        rc = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), self.kernel.func, ctypes.c_int(32 * warps), ctypes.c_size_t(0))
        if rc != 0:
            raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor: {rc}")
        self.max_per_sm = n.value
        self.per_sm = min(per_sm, n.value)
        self.blocks = torch.cuda.get_device_properties(0).multi_processor_count * self.per_sm
        self.counter = torch.zeros(1, dtype=torch.int32, device=DEV)
        self.error = torch.zeros(1, dtype=torch.int32, device=DEV)
        self.attr = _LaunchAttr()

    def __call__(self, ops: torch.Tensor, nops: int, scale: torch.Tensor) -> None:
        self.counter.zero_()
        ptrs = [ctypes.c_void_p(ops.data_ptr()), ctypes.c_int(nops),
                ctypes.c_void_p(scale.data_ptr()), ctypes.c_void_p(self.counter.data_ptr()),
                ctypes.c_void_p(self.error.data_ptr())]
        args = (ctypes.c_void_p * 5)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
                                       for a in ptrs])
        cfg = _LaunchConfig(self.blocks, 1, 1, 32 * self.warps, 1, 1, 0,
                            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                            ctypes.pointer(self.attr), 0)
        rc = _libcuda().cuLaunchKernelEx(ctypes.byref(cfg), self.kernel.func, args, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed: {rc}")


def build(layers: int):
    """Weights, activation buffers and the op table: op i reads op i-1's output."""
    scale = torch.tensor([1 / 64], device=DEV)
    x0 = torch.randn(1, 4096, device=DEV).to(torch.bfloat16)
    ops, table, prev = [], [], x0
    for _ in range(layers):
        for name, n, k in SHAPES:
            w = ((torch.randn(n, k, device=DEV) * k**-0.5) * 64).to(torch.float8_e4m3fn)
            y = torch.empty(1, n, device=DEV, dtype=torch.bfloat16)
            x = prev[:, :k]  # o_proj reads qkv's first 4096 outputs, down gate_up's first 14336
            ops.append((name, w, x, y))
            table += [w.data_ptr(), x.data_ptr(), y.data_ptr(), n | (k << 32), 0]
            prev = y
    return scale, x0, ops, torch.tensor(table, dtype=torch.int64, device=DEV)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--per-sm", default="6,4")
    args = ap.parse_args()
    torch.manual_seed(0)
    scale, x0, ops, table = build(args.layers)
    nops = len(ops)
    nbytes = sum(w.numel() for _, w, _, _ in ops)
    cuda = CudaGemv("b:4x2x4", act=False, pdl=True)

    # the Triton GEMV returns fresh tensors: feed each output forward (a chain as well)
    def triton_chained(_):
        prev = x0
        for name, w, _x, _y in ops:
            k = w.shape[1]
            prev = gemv.gemv(prev[:, :k], w, scale)

    def cuda_chain(_):
        for _, w, x, y in ops:
            cuda(x, w, scale, y)

    rows = []
    # correctness: persistent == per-kernel CUDA chain (same per-row arithmetic)
    cuda_chain(0)
    torch.cuda.synchronize()
    want = ops[-1][3].clone()
    variants = []
    for per_sm in (int(v) for v in args.per_sm.split(",")):
        for pf in (True, False):
            variants.append((f"persistent R4 U2 W4, {per_sm}/SM{' +prefetch' if pf else ''}",
                             Persistent(4, 2, 4, per_sm, pf)))
    for label, p in variants:
        ops[-1][3].zero_()
        p(table, nops, scale)
        torch.cuda.synchronize()
        err = int(p.error.item())
        same = torch.equal(ops[-1][3], want)
        print(f"{label}: grid {p.blocks} (max {p.max_per_sm}/SM), barrier timeouts {err}, "
              f"last output == per-kernel chain: {same}", flush=True)
    for label, fn in [("triton (shipped), PDL", triton_chained), ("cuda R4 U2 W4, PDL", cuda_chain)] + [
            (label, lambda _, p=p: p(table, nops, scale)) for label, p in variants] + [
            ("triton (shipped), PDL", triton_chained)]:
        ms = time_us(fn, copies=1, reps=8)["us"] / 1e3
        rows.append(f"| {label} | {ms:.3f} | {nbytes / ms / 1e9:.2f} |")
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}: {nops} chained FP8 GEMVs ({nbytes / 1e9:.2f} GB)")
    print("| form | ms | TB/s |\n|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
