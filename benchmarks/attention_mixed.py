"""One layer's paged attention in a serving step, on the GPU: B decodes at ~C tokens of
context, alone and beside P prompts of L tokens, as one launch (every sequence in the step's
largest tile class, kiln before 2026-12-06) and as two (decodes in decode tiles, prompts in
prompt tiles). llama-3-8b shape (32 heads, 8 KV heads, head_dim 128), block size 16.

usage: python benchmarks/attention_mixed.py [B=256] [C=1000] [P=4] [L=1000]
Prints us per call and the KV bandwidth (bytes of K and V read once / time) per variant; the
decodes alone also per launch config (register caps, block ids a tile ahead and FP8 V read as
32-bit words included) and
per KV layout (NHD, HND) at the default config."""

from __future__ import annotations

import sys

import torch

from kiln.runtime.kernels.paged_attention import flops_and_bytes, paged_attention
from kiln.runtime.kernels.testing import random_paged_batch, with_layout


def time_us(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    b, c, p, n = (int(a) for a in (sys.argv[1:] + ["256", "1000", "4", "1000"][len(sys.argv) - 1:]))
    heads, kvh, dim = 32, 8, 128
    print(f"{torch.cuda.get_device_name()}: {b} decodes at ~{c} context, {p} prompts of {n}")
    print(f"{'kv':>9} {'step':>22} {'launches':>9} {'us':>9} {'TB/s':>6}")
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        torch.manual_seed(0)
        decodes = [(c - 1 + (i % 64), 1, False) for i in range(b)]
        for name, specs in (("decodes only", decodes),
                            (f"+ {p} x {n} prompts", decodes + [(0, n, False)] * p)):
            batch = random_paged_batch(specs, heads, kvh, dim, 16, torch.bfloat16, "cuda",
                                       cache_dtype=kv)
            ctx = [pre + q for pre, q, _ in specs]
            _, nbytes = flops_and_bytes(ctx, [q for _, q, _ in specs], heads, kvh, dim,
                                        batch.k_cache.element_size())
            scales = ({"k_scale": torch.ones(1, device="cuda"),
                       "v_scale": torch.ones(1, device="cuda")} if kv != torch.bfloat16 else {})
            out = torch.empty_like(batch.q)
            if name == "decodes only":  # the decode class's launch configs
                # (a register cap applies to launches of one split a program; the FP8
                # default's, 128, also converts V as loaded)
                for cfg in [{"BLOCK_N": bn, "num_warps": w, "num_stages": st,
                             "tiles_per_split": 2}
                            for bn in (32, 64, 128, 256) for w in (2, 4, 8) for st in (2, 3, 4)
                            ] + [{"BLOCK_N": 128, "num_warps": 4, "num_stages": st,
                                  "tiles_per_split": 2, "maxnreg": r}
                                 for st in (2, 3) for r in (96, 128, 168)
                            ] + [{"BLOCK_N": 128, "num_warps": 4, "num_stages": 2,
                                  "tiles_per_split": 2, "maxnreg": 128, "v_asm": False}
                            ] + [{"BLOCK_N": bn, "num_warps": 4, "num_stages": st,
                                  "tiles_per_split": 2, "v_asm": 2, **cap}
                                 for bn in (64, 128) for st in (2, 3)
                                 for cap in ({}, {"maxnreg": 128})
                            ] + [{"BLOCK_N": bn, "num_warps": 4, "num_stages": st,
                                  "tiles_per_split": 2, "bt_ahead": True, **cap}
                                 for bn in (64, 128) for st in (3, 4)
                                 for cap in ({}, {"maxnreg": 128})]:
                    try:
                        us = time_us(lambda: paged_attention(
                            *batch.args(), dim ** -0.5, max_query_len=1,
                            max_context_len=batch.max_context_len, out=out, config=cfg,
                            **scales))
                    except Exception as e:  # a config that does not fit
                        print(f"  decode {cfg}: {type(e).__name__}")
                        continue
                    cap = (f" r{cfg['maxnreg']}" if "maxnreg" in cfg else "") + (
                        " ahead" if cfg.get("bt_ahead") else "") + (
                        " no-asm" if cfg.get("v_asm") is False else "") + (
                        " words" if cfg.get("v_asm") == 2 else "")
                    print(f"{str(kv).removeprefix('torch.'):>9} decode {cfg['BLOCK_N']:>4} "
                          f"w{cfg['num_warps']} s{cfg['num_stages']}{cap} {us:9.1f} "
                          f"{nbytes / us / 1e6:6.2f}")
                for layout in ("NHD", "HND"):  # the KV layouts (kiln/runtime/kv_cache.py)
                    args = (batch.q, with_layout(batch.k_cache, layout),
                            with_layout(batch.v_cache, layout), *batch.args()[3:])
                    us = time_us(lambda: paged_attention(
                        *args, dim ** -0.5, max_query_len=1,
                        max_context_len=batch.max_context_len, out=out, **scales))
                    print(f"{str(kv).removeprefix('torch.'):>9} decode, {layout} cache "
                          f"{us:9.1f} {nbytes / us / 1e6:6.2f}")
                    del args
            variants = [("one", 0)] if name == "decodes only" else [("one", 0), ("two", b)]
            for label, singles in variants:
                us = time_us(lambda: paged_attention(
                    *batch.args(), dim ** -0.5, max_query_len=batch.max_query_len,
                    max_context_len=batch.max_context_len, out=out, single_rows=singles or None,
                    **scales) if singles else paged_attention(
                    *batch.args(), dim ** -0.5, max_query_len=batch.max_query_len,
                    max_context_len=batch.max_context_len, out=out, single_rows=0, **scales))
                print(f"{str(kv).removeprefix('torch.'):>9} {name:>22} {label:>9} {us:9.1f} "
                      f"{nbytes / us / 1e6:6.2f}")
            del batch
            torch.cuda.empty_cache()
        # the prompts alone: the prompt class's default tile and other launch configs
        batch = random_paged_batch([(0, n, False)] * p, heads, kvh, dim, 16, torch.bfloat16,
                                   "cuda", cache_dtype=kv)
        scales = ({"k_scale": torch.ones(1, device="cuda"),
                   "v_scale": torch.ones(1, device="cuda")} if kv != torch.bfloat16 else {})
        out = torch.empty_like(batch.q)
        flops, _ = flops_and_bytes([n] * p, [n] * p, heads, kvh, dim, 2)
        flops /= 2  # causal
        for cfg in [None] + [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st,
                              "tiles_per_split": 2}
                             for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8)
                             for st in (2, 3)] + [
                            {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": w, "num_stages": st,
                             "tiles_per_split": 2, "bt_ahead": True}
                            for w in (4, 8) for st in (3, 4)]:
            try:
                us = time_us(lambda: paged_attention(
                    *batch.args(), dim ** -0.5, max_query_len=n, max_context_len=n, out=out,
                    config=cfg, **scales))
            except Exception as e:  # a config that does not fit
                print(f"{str(kv).removeprefix('torch.'):>9} prompts {cfg}: {type(e).__name__}")
                continue
            print(f"{str(kv).removeprefix('torch.'):>9} {p} x {n} prompts alone {cfg or 'default'}"
                  f" {us:9.1f} us {flops / us / 1e6:7.1f} TFLOP/s")
        del batch
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
