"""Probe: a hand-written CUDA one-row FP8 GEMV (compiled at run time by NVRTC through
``torch.cuda._compile_kernel``, no nvcc) against kiln's Triton GEMV, in the 8B chain.

The question it answers for the lead (issue 6, FP8 >= 400 tok/s): does a kernel outside
Triton stream the FP8 weights of a batch-1 decode step faster than the Triton GEMV's
~3.5 TB/s (bf16 reaches ~4.05)? Design of the CUDA kernel: a warp owns R rows; every lane
loads 16 e4m3 (one 16-byte vector) per row per step of 512 columns, U steps in flight in
registers (R * U * 16 bytes per thread), float32 accumulators (one per row), a warp
shuffle reduction at the end: no shared memory, no barrier. Under PDL the first U steps'
weight loads are issued before ``griddepcontrol.wait`` (weights are read-only), x after.

    PYTHONPATH=.:scripts python3 scripts/cuda_gemv_probe.py [--variants 2x4x4,4x2x4]

Prints correctness (max error against a float32 reference and against the Triton GEMV),
then per-shape chains (32 distinct weights of one shape, HBM-cold) and the whole 8B chain
(32 x (qkv, o_proj, gate_up, down with SiLU) + the bf16 lm_head on Triton in every
variant), ms and TB/s, one CUDA graph of 16 chains per timing. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch
from bench_gemv import time_us  # scripts/ is on sys.path

from kiln.runtime.kernels import gemv

DEV = "cuda"
LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}

SOURCE = r"""
typedef unsigned short bf16_t;

__device__ __forceinline__ float bf2f(unsigned short h) {
    return __uint_as_float(((unsigned)h) << 16);
}
__device__ __forceinline__ unsigned short f2bf(float f) {  // round to nearest even
    unsigned u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ void e4m3x4(unsigned w, float* o) {
    unsigned h0, h1;
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n"
        " cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;\n}"
        : "=r"(h0), "=r"(h1) : "r"(w));
    asm("{\n .reg .f16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
        : "=f"(o[0]), "=f"(o[1]) : "r"(h0));
    asm("{\n .reg .f16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
        : "=f"(o[2]), "=f"(o[3]) : "r"(h1));
}
__device__ __forceinline__ uint4 ldw(const unsigned char* p, unsigned long long pol) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    return v;
}
// a += the 16 e4m3 weights of v times xf[0..15], in order (float32 FMAs)
__device__ __forceinline__ float dot16(uint4 v, const float* xf, float a) {
    float f[16];
    e4m3x4(v.x, f); e4m3x4(v.y, f + 4); e4m3x4(v.z, f + 8); e4m3x4(v.w, f + 12);
#pragma unroll
    for (int i = 0; i < 16; ++i) a = fmaf(f[i], xf[i], a);
    return a;
}
__device__ __forceinline__ float warp_sum(float a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    return a;
}
__device__ __forceinline__ void load_x16(const bf16_t* x, int k, int K, float* xf) {
    const uint4* p = reinterpret_cast<const uint4*>(x + k);
    uint4 a = __ldg(p), b = __ldg(p + 1);
    unsigned v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        xf[2 * i] = __uint_as_float(v[i] << 16);
        xf[2 * i + 1] = __uint_as_float(v[i] & 0xFFFF0000u);
    }
#if ACT
    // x holds [gate | up]: the input is silu(gate) * up, rounded as activation.py does
    const uint4* q = reinterpret_cast<const uint4*>(x + K + k);
    uint4 c = __ldg(q), d = __ldg(q + 1);
    unsigned u[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float u0 = __uint_as_float(u[i] << 16), u1 = __uint_as_float(u[i] & 0xFFFF0000u);
        float g0 = xf[2 * i], g1 = xf[2 * i + 1];
        float a0 = bf2f(f2bf(__fdividef(g0, 1.0f + __expf(-g0))));
        float a1 = bf2f(f2bf(__fdividef(g1, 1.0f + __expf(-g1))));
        xf[2 * i] = bf2f(f2bf(a0 * u0));
        xf[2 * i + 1] = bf2f(f2bf(a1 * u1));
    }
#endif
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32)
kiln_gemv_fp8(const bf16_t* __restrict__ x, const unsigned char* __restrict__ w,
              const float* __restrict__ scale, bf16_t* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * NWARPS + (threadIdx.x >> 5)) * ROWS_W;
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    const unsigned char* wp[ROWS_W];
#pragma unroll
    for (int r = 0; r < ROWS_W; ++r)
        wp[r] = w + (size_t)min(row0 + r, N - 1) * K + lane * 16;
    const int nsteps = K / 512;
    uint4 buf[AHEAD][ROWS_W];
#pragma unroll
    for (int u = 0; u < AHEAD; ++u)
#pragma unroll
        for (int r = 0; r < ROWS_W; ++r)
            if (u < nsteps) buf[u][r] = ldw(wp[r] + u * 512, pol);
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    float acc[ROWS_W];
#pragma unroll
    for (int r = 0; r < ROWS_W; ++r) acc[r] = 0.0f;
    for (int s = 0; s < nsteps; s += AHEAD) {
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            if (s + u < nsteps) {
                float xf[16];
                load_x16(x, (s + u) * 512 + lane * 16, K, xf);
#pragma unroll
                for (int r = 0; r < ROWS_W; ++r) {
                    uint4 v = buf[u][r];
                    if (s + u + AHEAD < nsteps) buf[u][r] = ldw(wp[r] + (s + u + AHEAD) * 512, pol);
                    acc[r] = dot16(v, xf, acc[r]);
                }
            }
        }
    }
    const float sc = *scale;
#pragma unroll
    for (int r = 0; r < ROWS_W; ++r) {
        const float a = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < N) y[row0 + r] = f2bf(a * sc);
    }
}

// Persistent streaming form: grid = SMs x CTAS_PER_SM (dynamic shared memory caps how many
// CTAs of one kernel share an SM, leaving room for the next kernel's CTAs to become resident
// under PDL and issue their weight loads before their wait). A warp walks a flat sequence of
// (row group, K step) items with AHEAD items' loads in flight: no bubble between row groups.
extern "C" __global__ void __launch_bounds__(NWARPS * 32)
kiln_gemv_fp8_stream(const bf16_t* __restrict__ x, const unsigned char* __restrict__ w,
                     const float* __restrict__ scale, bf16_t* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int gwarp = blockIdx.x * NWARPS + (threadIdx.x >> 5);
    const int nwarps = gridDim.x * NWARPS;
    const int ngroups = (N + ROWS_W - 1) / ROWS_W;
    const int nsteps = K / 512;
    // this warp's row groups: gwarp, gwarp + nwarps, ...; items t = local group * nsteps + step
    const int mygroups = gwarp < ngroups ? (ngroups - 1 - gwarp) / nwarps + 1 : 0;
    const int T = mygroups * nsteps;
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    uint4 buf[AHEAD][ROWS_W];
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) {
        if (u < T) {
            const int g = gwarp + (u / nsteps) * nwarps, st = u % nsteps;
#pragma unroll
            for (int r = 0; r < ROWS_W; ++r)
                buf[u][r] = ldw(w + (size_t)min(g * ROWS_W + r, N - 1) * K + st * 512 + lane * 16, pol);
        }
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    const float sc = *scale;
    float acc[ROWS_W];
#pragma unroll
    for (int r = 0; r < ROWS_W; ++r) acc[r] = 0.0f;
    int g = gwarp, st = 0;        // the item being consumed
    int lg = gwarp + (AHEAD / nsteps) * nwarps, lst = AHEAD % nsteps;  // the next item to load
    for (int t = 0; t < T; t += AHEAD) {
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            if (t + u < T) {
                float xf[16];
                load_x16(x, st * 512 + lane * 16, K, xf);
                const bool more = t + u + AHEAD < T;
#pragma unroll
                for (int r = 0; r < ROWS_W; ++r) {
                    uint4 v = buf[u][r];
                    if (more)
                        buf[u][r] = ldw(w + (size_t)min(lg * ROWS_W + r, N - 1) * K + lst * 512 + lane * 16, pol);
                    acc[r] = dot16(v, xf, acc[r]);
                }
                if (++lst == nsteps) { lst = 0; lg += nwarps; }
                if (++st == nsteps) {  // the row group is done: reduce, store, restart
#pragma unroll
                    for (int r = 0; r < ROWS_W; ++r) {
                        const float a = warp_sum(acc[r]);
                        if (lane == 0 && g * ROWS_W + r < N) y[g * ROWS_W + r] = f2bf(a * sc);
                        acc[r] = 0.0f;
                    }
                    st = 0;
                    g += nwarps;
                }
            }
        }
    }
}
"""

_LIB = None


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("nattrs", ctypes.c_uint)]


def _libcuda():
    global _LIB
    if _LIB is None:
        _LIB = ctypes.CDLL("libcuda.so.1")
    return _LIB


class CudaGemv:
    """One compiled variant. ``spec``: ``b:RxUxW`` (a CTA of W warps owns W * R rows) or
    ``s:RxUxWxP`` (persistent streaming: P CTAs per SM walk the row groups)."""

    def __init__(self, spec: str, act: bool, pdl: bool):
        kind, dims = spec.split(":")
        vals = [int(v) for v in dims.split("x")]
        self.kind, self.r, self.u, self.warps = kind, vals[0], vals[1], vals[2]
        self.per_sm = vals[3] if kind == "s" else 0
        self.pdl = pdl
        opts = [f"-DROWS_W={self.r}", f"-DAHEAD={self.u}", f"-DNWARPS={self.warps}",
                f"-DACT={int(act)}", f"-DPDL={int(pdl)}"]
        name = "kiln_gemv_fp8_stream" if kind == "s" else "kiln_gemv_fp8"
        self.kernel = torch.cuda._compile_kernel(SOURCE, name, nvcc_options=opts)
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.attr = _LaunchAttr()
        self.attr.id = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self.attr.value[0] = 1

    def __call__(self, x, w, scale, y=None):
        n, k = w.shape
        assert k % 512 == 0, k
        if y is None:
            y = torch.empty(1, n, device=x.device, dtype=torch.bfloat16)
        rows = self.r * self.warps
        blocks = (n + rows - 1) // rows
        if self.kind == "s":
            blocks = min(blocks, self.sms * self.per_sm)
        ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (x, w, scale, y)]
        ints = [ctypes.c_int(n), ctypes.c_int(k)]
        args = (ctypes.c_void_p * 6)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
                                       for a in ptrs + ints])
        cfg = _LaunchConfig(blocks, 1, 1, 32 * self.warps, 1, 1, 0,
                            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                            ctypes.pointer(self.attr), 1 if self.pdl else 0)
        lib = _libcuda()
        rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), self.kernel.func, args, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed: {rc}")
        return y


def make_weights():
    layers = []
    for _ in range(LAYERS):
        layer = {}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k**-0.5
            layer[name] = ((w * 64).to(torch.float8_e4m3fn), torch.tensor([1 / 64], device=DEV))
            del w
        layers.append(layer)
    lm_head = torch.randn(128256, 4096, device=DEV, dtype=torch.bfloat16) * 4096**-0.5
    return layers, lm_head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="b:4x2x4,b:2x2x4,s:2x4x8x1,s:2x4x4x2,s:2x4x4x3,"
                    "s:2x8x8x1,s:4x2x8x1,s:2x4x8x2,s:4x4x4x2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    variants = args.variants.split(",")
    kern = {}
    for v in variants:
        for act in (False, True):
            for pdl in (False, True):
                kern[(v, act, pdl)] = CudaGemv(v, act, pdl)
    layers, lm_head = make_weights()
    x = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    gu = torch.randn(1, 2 * 14336, device=DEV, dtype=torch.bfloat16)
    res = {"card": torch.cuda.get_device_name(), "correct": {}, "shape_ms": {}, "chain_ms": {}}
    rows = []

    # correctness: every variant, every shape, against float32 and against the Triton GEMV
    for name, (n, k) in SHAPES.items():
        w, s = layers[0][name]
        act = name == "down"
        xin = gu if act else x
        if act:
            g, up = gu[:, :k].float(), gu[:, k:].float()
            xr = ((g * torch.sigmoid(g)).bfloat16().float() * up).bfloat16().float()
        else:
            xr = x.float()
        ref = xr @ (w.float() * s).t()
        tri = gemv.gemv(xin, w, s, silu_and_mul=act).float()
        scale = ref.abs().max().item()
        for v in variants:
            for pdl in (False, True):
                out = kern[(v, act, pdl)](xin, w, s).float()
                e_ref = (out - ref).abs().max().item() / scale
                e_tri = (out - tri).abs().max().item() / scale
                res["correct"][f"{name} {v} pdl{int(pdl)}"] = (e_ref, e_tri)
                line = f"{name} {v} pdl{int(pdl)}: err/ref {e_ref:.2e} err/triton {e_tri:.2e}"
                print(line, flush=True)
                assert e_ref < 2e-2, line
        print(f"{name} triton err/ref {(tri - ref).abs().max().item() / scale:.2e}", flush=True)

    def shape_chain(name, fn):
        def run(_):
            for layer in layers:
                w, s = layer[name]
                fn(w, s)
        return time_us(run, copies=1, reps=8)["us"] / 1e3

    for name, (n, k) in SHAPES.items():
        act = name == "down"
        xin = gu if act else x
        nbytes = LAYERS * n * k
        t = shape_chain(name, lambda w, s, xin=xin, act=act: gemv.gemv(xin, w, s, silu_and_mul=act))
        rows.append(f"| {name} x32 | triton | {t:.3f} | {nbytes / t / 1e9:.2f} |")
        print(rows[-1], flush=True)
        res["shape_ms"][f"{name} triton"] = t
        for v in variants:
            kf = kern[(v, act, True)]
            t = shape_chain(name, lambda w, s, kf=kf, xin=xin: kf(xin, w, s))
            rows.append(f"| {name} x32 | cuda {v} | {t:.3f} | {nbytes / t / 1e9:.2f} |")
            print(rows[-1], flush=True)
            res["shape_ms"][f"{name} {v}"] = t

    # the whole step's GEMVs: per shape, the best CUDA variant of the shape chains
    best = {name: min(variants, key=lambda v: res["shape_ms"][f"{name} {v}"]) for name in SHAPES}
    res["best"] = best
    total = sum(w.numel() for layer in layers for w, _ in layer.values()) + lm_head.numel() * 2

    def step_chain(use_cuda: bool, pdl: bool = True):
        def run(_):
            for layer in layers:
                for name in ("qkv", "o_proj", "gate_up", "down"):
                    w, s = layer[name]
                    act = name == "down"
                    xin = gu if act else x
                    if use_cuda:
                        kern[(best[name], act, pdl)](xin, w, s)
                    else:
                        gemv.gemv(xin, w, s, silu_and_mul=act)
            gemv.gemv(x, lm_head)
        return time_us(run, copies=1, reps=8)["us"] / 1e3

    for label, uc, pdl in (("triton", False, True), ("cuda best", True, True),
                           ("triton", False, True), ("cuda best", True, True),
                           ("cuda best, no PDL", True, False)):
        t = step_chain(uc, pdl)
        rows.append(f"| 8B step GEMVs | {label} | {t:.3f} | {total / t / 1e9:.2f} |")
        print(rows[-1], flush=True)
        res["chain_ms"].setdefault(label, []).append(t)

    print(f"\n{res['card']}; best CUDA variant per shape: {best}")
    print("| chain | kernel | ms | TB/s |\n|---|---|---|---|")
    for r in rows:
        print(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
