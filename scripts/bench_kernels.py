"""Microbenchmark: each Triton kernel vs its torch/eager equivalent on CUDA.

Usage (on the GPU machine):  PYTHONPATH=. python scripts/bench_kernels.py [--json FILE]
Times are medians of CUDA-event timings (triton.testing.do_bench) over inputs rotated
through several buffers (> L2, so the numbers are HBM numbers). "graph" replays a CUDA
graph of the launches (device time, no host overhead); "eager" includes the Python
wrapper and launch cost. GB/s counts each input read once and each output written once;
the copy ceiling measured on the H200 is 4.23 TB/s.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.testing import do_bench

from kiln.runtime.kernels import activation, kv_write, rms_norm, rotary
from kiln.runtime.kernels.paged_attention import (
    flops_and_bytes,
    paged_attention,
    paged_attention_ref,
)
from kiln.runtime.kernels.testing import random_paged_batch, rel_err
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import AttentionMetadata, SeqAttention, TorchAttention
from kiln.runtime.layers.norm import rms_norm as rms_norm_eager
from kiln.runtime.layers.rotary import Rotary

DEV = "cuda"
BF16 = torch.bfloat16
ROWS: list[dict] = []


def bench_eager(fns: list) -> float:
    """Median ms of one call, cycling through ``fns`` (one per buffer set)."""
    it = [0]

    def step():
        fns[it[0] % len(fns)]()
        it[0] += 1

    return do_bench(step, warmup=50, rep=300, return_mode="median")


def bench_graph(fns: list) -> float:
    """Median ms of one call: a CUDA graph of all ``fns`` replayed, divided by their count."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return do_bench(g.replay, warmup=50, rep=300, return_mode="median") / len(fns)


def row(kernel: str, shape: str, nbytes: float, triton_fns: list, ref_fns: list,
        flops: float = 0.0, ref_graph: bool = True) -> None:
    tg = bench_graph(triton_fns)
    te = bench_eager(triton_fns)
    rg = bench_graph(ref_fns) if ref_graph else float("nan")
    re = bench_eager(ref_fns)
    r = {"kernel": kernel, "shape": shape, "triton_graph_us": tg * 1e3,
         "triton_eager_us": te * 1e3, "torch_graph_us": rg * 1e3, "torch_eager_us": re * 1e3,
         "triton_GBps": nbytes / (tg * 1e-3) / 1e9, "torch_GBps": nbytes / (rg * 1e-3) / 1e9,
         "speedup_graph": rg / tg, "bytes": nbytes}
    if flops:
        r["triton_TFLOPs"] = flops / (tg * 1e-3) / 1e12
    ROWS.append(r)
    print(f"{kernel:22s} {shape:34s} triton {tg * 1e3:8.1f} us ({r['triton_GBps']:6.0f} GB/s,"
          f" eager {te * 1e3:7.1f})  torch {rg * 1e3:8.1f} us (eager {re * 1e3:8.1f})"
          f"  x{r['speedup_graph']:.2f}", flush=True)


def nbuf(bytes_per_set: float, floor: int = 4, target: float = 256e6) -> int:
    return max(floor, min(64, int(target // max(bytes_per_set, 1)) + 1))


def bench_elementwise() -> None:
    for t in (1, 64, 4096):
        _silu(t)
        _norm(t)
        _rotary(t)
    for t, cache_dtype in ((64, BF16), (4096, BF16), (64, torch.float8_e4m3fn),
                           (4096, torch.float8_e4m3fn)):
        _kv_write(t, cache_dtype)


def _silu(t: int, inter: int = 14336) -> None:  # llama-3-8b intermediate size
    xs = [torch.randn(t, 2 * inter, device=DEV, dtype=BF16) for _ in range(nbuf(t * inter * 6))]
    row("silu_and_mul", f"T={t} I={inter} bf16", t * inter * 6,
        [lambda x=x: activation.silu_and_mul(x) for x in xs],
        [lambda x=x: activation.silu_and_mul_ref(x) for x in xs])


def _norm(t: int, hid: int = 4096) -> None:
    sets = [(torch.randn(t, hid, device=DEV, dtype=BF16),
             torch.randn(t, hid, device=DEV, dtype=BF16)) for _ in range(nbuf(t * hid * 8))]
    w = torch.randn(hid, device=DEV, dtype=BF16)
    row("fused_add_rms_norm", f"T={t} hidden={hid} bf16", t * hid * 8 + hid * 2,
        [lambda a=a, r=r: rms_norm.fused_add_rms_norm(a, r, w, 1e-5) for a, r in sets],
        [lambda a=a, r=r: rms_norm_eager(a + r, w, 1e-5) for a, r in sets])


def _rotary(t: int) -> None:
    """q [T, 32, 128], k [T, 8, 128] in place; eager = cos_sin from positions + Rotary.apply."""
    inv = 1.0 / (500000 ** (torch.arange(0, 128, 2, device=DEV).float() / 128))
    cache = rotary.build_cos_sin_cache(inv, 8192)
    sets = [(torch.randn(t, 32, 128, device=DEV, dtype=BF16),
             torch.randn(t, 8, 128, device=DEV, dtype=BF16),
             torch.randint(0, 8192, (t,), device=DEV)) for _ in range(nbuf(t * 40 * 128 * 4))]

    def eager_rot(q, k, pos):
        freqs = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(BF16)[:, None, :], emb.sin().to(BF16)[:, None, :]
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)

    row("rotary (in place)", f"T={t} 32/8 heads d128 bf16", t * 40 * 128 * 4,
        [lambda s=s: rotary.rotary_embedding_(s[0], s[1], s[2], cache) for s in sets],
        [lambda s=s: eager_rot(*s) for s in sets])


def _kv_write(t: int, cache_dtype: torch.dtype) -> None:
    """llama-3-8b kv shape [T, 8, 128] into a [512, 16, 8, 128] cache."""
    fp8 = cache_dtype == torch.float8_e4m3fn
    elem = 1 if fp8 else 2
    blocks = 512
    kc = torch.randn(blocks, 16, 8, 128, device=DEV).to(cache_dtype)
    vc = torch.randn(blocks, 16, 8, 128, device=DEV).to(cache_dtype)
    sets = [(torch.randn(t, 8, 128, device=DEV, dtype=BF16),
             torch.randn(t, 8, 128, device=DEV, dtype=BF16),
             torch.randperm(blocks * 16, device=DEV)[:t]) for _ in range(nbuf(t * 8 * 128 * 4))]
    ks = torch.tensor([0.5], device=DEV)
    kc3, vc3 = kc.view(-1, 8, 128), vc.view(-1, 8, 128)

    def eager_write(k, v, slots):  # write_kv's formulation
        if fp8:
            k8 = (k.float() / ks).clamp(-448, 448).to(cache_dtype)
            v8 = (v.float() / ks).clamp(-448, 448).to(cache_dtype)
            kc3.view(torch.uint8).index_copy_(0, slots, k8.view(torch.uint8))
            vc3.view(torch.uint8).index_copy_(0, slots, v8.view(torch.uint8))
        else:
            kc3.index_copy_(0, slots, k)
            vc3.index_copy_(0, slots, v)

    row("reshape_and_cache", f"T={t} 8x128 -> {str(cache_dtype)[6:]}",
        t * 8 * 128 * (4 + 2 * elem),
        [lambda s=s: kv_write.reshape_and_cache(s[0], s[1], kc, vc, s[2], ks, ks)
         for s in sets],
        [lambda s=s: eager_write(*s) for s in sets])


def bench_attention() -> None:
    """Decode batch 1/64 x context 512/2048, a 40-token lookahead step, a prefill chunk."""
    cases = []
    for name, (h, kvh, d) in {"llama-3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}.items():
        for batch in (1, 64):
            for ctx in (512, 2048):
                cases.append((name, h, kvh, d, f"decode b={batch} ctx={ctx}",
                              [(ctx - 1, 1, False)] * batch))
        cases.append((name, h, kvh, d, "lookahead b=1 ctx=512 q=40 tree",
                       [(472, 40, True)]))
        cases.append((name, h, kvh, d, "lookahead b=8 ctx=2048 q=40 tree",
                       [(2008, 40, True)] * 8))
        cases.append((name, h, kvh, d, "prefill chunk q=2048 ctx=2048", [(0, 2048, False)]))
    for case in cases:
        _attention_case(*case)


def _attention_case(name: str, h: int, kvh: int, d: int, label: str, specs: list) -> None:
    batches = []
    kv_bytes = sum(p + n for p, n, _ in specs) * kvh * d * 2 * 2
    for _ in range(nbuf(kv_bytes, floor=2, target=400e6)):
        batches.append(random_paged_batch(specs, h, kvh, d, 16, BF16, DEV, spare_blocks=0))
    b0 = batches[0]
    out = paged_attention(*b0.args(), d**-0.5, max_query_len=b0.max_query_len,
                          max_context_len=b0.max_context_len, **b0.kwargs())
    err = rel_err(out, paged_attention_ref(*b0.args(), d**-0.5, **b0.kwargs()))
    flops, nbytes = flops_and_bytes(b0.context_lens.tolist(),
                                    (b0.query_start_loc.diff()).tolist(), h, kvh, d, 2)
    tri = [lambda b=b: paged_attention(*b.args(), d**-0.5, max_query_len=b.max_query_len,
                                       max_context_len=b.max_context_len, **b.kwargs())
           for b in batches]
    ref = [_torch_backend_call(b, h, kvh, d) for b in batches]
    row("paged_attention", f"{name} {label}", nbytes, tri, ref, flops=flops,
        ref_graph=len(specs) <= 8)
    ROWS[-1]["rel_err_vs_ref"] = err


def _torch_backend_call(b, h, kvh, d):
    """TorchAttention over the same cache (its own KV write of the step's tokens included)."""
    cache = KVCache.__new__(KVCache)
    cache.k, cache.v = b.k_cache[None], b.v_cache[None]
    cache.block_size = b.k_cache.shape[1]
    cache.is_fp8 = False
    cache.k_scale = cache.v_scale = torch.ones(1, device=DEV)
    bs = cache.block_size
    seqs, slots = [], []
    qsl, ctx = b.query_start_loc.tolist(), b.context_lens.tolist()
    offs = b.mask_offsets.tolist() if b.mask_offsets is not None else [-1] * len(ctx)
    for s, c in enumerate(ctx):
        n = qsl[s + 1] - qsl[s]
        idx = torch.arange(c, device=DEV)
        key_slots = b.block_tables[s].long()[idx // bs] * bs + idx % bs
        mask = None
        if offs[s] >= 0:
            mask = b.mask[offs[s] : offs[s] + n * n].view(n, n).bool()
        seqs.append(SeqAttention(qsl[s], n, c, key_slots, mask))
        slots.append(key_slots[c - n :])
    meta = AttentionMetadata(torch.cat(slots), seqs)
    t = b.q.shape[0]
    k = torch.randn(t, kvh, d, device=DEV, dtype=BF16)
    backend = TorchAttention()
    return lambda: backend.forward(0, b.q, k, k, cache, meta, d**-0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all rows to this file")
    ap.add_argument("--only", choices=["elementwise", "attention"], help="run one group")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if args.only != "attention":
        bench_elementwise()
    if args.only != "elementwise":
        bench_attention()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    print("\n| kernel | shape | triton graph µs | GB/s | torch graph µs | torch eager µs | x |")
    print("|---|---|---|---|---|---|---|")
    for r in ROWS:
        print(f"| {r['kernel']} | {r['shape']} | {r['triton_graph_us']:.1f} | "
              f"{r['triton_GBps']:.0f} | {r['torch_graph_us']:.1f} | {r['torch_eager_us']:.1f} |"
              f" {r['speedup_graph']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
