"""The built-in tunables, ``BUILTINS`` (paged_attention, gemv), which
kiln/runtime/kernels/tuning.py tunes. This module imports the kernels; none imports it back
(a kernel's wrapper finds its tuned configs in kiln/runtime/kernels/tuned_configs.py).

Inputs are made once per problem (seeded, on the device) and shared by run and bench;
``release`` drops them. Several copies of the KV cache / weight are cycled through so a
shape that fits in L2 is timed as it runs in a model (a different layer every call).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from kiln.runtime import env
from kiln.runtime.kernels import gemv, gemv_configs, paged_attention
from kiln.runtime.kernels._checks import FP8_DTYPES, next_pow2
from kiln.runtime.kernels.testing import random_paged_batch
from kiln.runtime.kernels.tunable import Tunable, TuneTarget, time_cuda, torch_dtype

_INPUTS: dict[str, Any] = {}
_L2_BYTES = 192 << 20  # cycle through copies until this many bytes are touched


def _cached(problem: dict, device: torch.device, make: Callable[[], Any]) -> Any:
    key = json.dumps(problem, sort_keys=True) + str(device)
    if key not in _INPUTS:
        _INPUTS.clear()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            _INPUTS[key] = make()
    return _INPUTS[key]


def _release() -> None:
    _INPUTS.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _copies(nbytes: int) -> int:
    return max(1, min(32, -(-_L2_BYTES // max(nbytes, 1))))


def _attention_problems(t: TuneTarget) -> list[dict]:
    """Decode at batch 1 and max_batch_size, context min(2048, max_seq_len); with
    speculation also the speculative step (tokens per step, at batch 1 and the largest
    batch the token budget allows)."""
    m, lim = t.model, t.limits
    base = {"heads": m.num_heads, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "dtype": str(t.dtype).removeprefix("torch."),
            "kv_dtype": str(t.kv).removeprefix("torch."), "block_size": 16,
            "context": min(2048, lim.max_seq_len)}
    shapes = [(1, 1, False), (lim.max_batch_size, 1, False)]
    q = t.tokens_per_step
    if q > 1 and q < base["context"]:
        most = max(1, min(lim.max_batch_size, lim.max_num_tokens // q))
        shapes += [(1, q, t.tree_mask), (most, q, t.tree_mask)]
    out = []
    for batch, qlen, tree in dict.fromkeys(shapes):
        out.append({**base, "batch": batch, "query_len": qlen, "tree": tree})
    return out


def _attention_class(p: dict) -> str:
    """The problem's query class (``paged_attention.query_class``)."""
    return paged_attention.query_class(p["query_len"], p["heads"] // p["kv_heads"],
                                       bool(p["tree"]))


def _kv_fp8(p: dict) -> bool:
    return torch_dtype(p["kv_dtype"]) in FP8_DTYPES


def _attention_key(p: dict) -> str:
    return paged_attention.tuning_key(p["kv_heads"], p["heads"] // p["kv_heads"],
                                      p["head_dim"], p["dtype"], p["kv_dtype"], p["query_len"],
                                      bool(p["tree"]))


def _attention_candidates(p: dict) -> list[dict]:
    """BLOCK_N x warps x stages at the default split rule, then the split rule per BLOCK_N
    (24 configs), and 4 that load the block ids a tile ahead (FP8 decodes: under a register
    cap, 2 more capped, and 4 capped that read V as 32-bit words). 16-row tiles (decode) try
    2 and 4 warps, 64-row 4 and 8.
    Tree-masked steps: tile rows x BLOCK_N x the least tiles per split, and the default (19
    configs; the best of them per shape: 0.76x the old default's time, geometric mean over
    the 135M / 1.5B / 7B shapes, docs/decisions.md)."""
    wide = next_pow2(max(p["head_dim"], 16)) > 128
    block_ns = (16, 32, 64) if wide else (32, 64, 128)
    qclass = _attention_class(p)
    if qclass == "tree":  # 16-row tiles and a least split length matter here too
        return [{"BLOCK_N": bn, "num_warps": 4, "num_stages": 2, "tiles_per_split": 2,
                 "BLOCK_M": bm, "min_split_tiles": mt}
                for bm in (16, 32, 64) for bn in block_ns[:2] for mt in (0, 4, 16)] + [
                paged_attention.default_config(p["head_dim"], qclass, _kv_fp8(p))]
    warps = (4, 8) if qclass == "prefill" else (2, 4)
    out = [{"BLOCK_N": bn, "num_warps": w, "num_stages": st, "tiles_per_split": 2}
           for bn in block_ns for w in warps for st in (1, 2, 3)]
    out += [{"BLOCK_N": bn, "num_warps": 4, "num_stages": 2, "tiles_per_split": tps}
            for bn in block_ns for tps in (1, 4)]
    # block ids a tile ahead (multi-buffered K/V tiles), the FP8 decodes' also under their
    # register cap (paged_attention.default_config)
    # (128-row prompt tiles: 8 warps, which hold them without spilling: sm_90 compile)
    cap = {"maxnreg": 128} if qclass == "decode" and _kv_fp8(p) else {}
    rows = {"BLOCK_M": 128, "num_warps": 8} if qclass == "prefill" else {}
    out += [{"BLOCK_N": bn, "num_warps": 4, "num_stages": st, "tiles_per_split": 2,
             "bt_ahead": True, **rows, **cap} for bn in block_ns[1:] for st in (3, 4)]
    if cap:  # FP8 decodes: capped, and V read as 32-bit words (``v_asm`` 2)
        out += [{"BLOCK_N": bn, "num_warps": 4, "num_stages": 2, "tiles_per_split": 2, **cap}
                for bn in block_ns[1:]]
        out += [{"BLOCK_N": bn, "num_warps": 4, "num_stages": st, "tiles_per_split": 2,
                 "v_asm": 2, **cap} for bn in block_ns[1:] for st in (2, 3)]
    return out


def _attention_inputs(p: dict, device: torch.device) -> tuple:
    def make() -> tuple:
        dtype, kv = torch_dtype(p["dtype"]), torch_dtype(p["kv_dtype"])
        q = p["query_len"]
        specs = [(p["context"] - q, q, bool(p["tree"]))] * p["batch"]
        b = random_paged_batch(specs, p["heads"], p["kv_heads"], p["head_dim"],
                               p["block_size"], dtype, device, cache_dtype=kv,
                               layout=env.kv_layout())
        nbytes = 2 * b.k_cache.numel() * b.k_cache.element_size()
        caches = [(b.k_cache, b.v_cache)] + [(b.k_cache.clone(), b.v_cache.clone())
                                             for _ in range(_copies(nbytes) - 1)]
        scale = torch.full((1,), 0.5, dtype=torch.float32, device=device)
        return b, caches, scale, torch.empty_like(b.q)

    return _cached(p, device, make)


def _attention_call(p: dict, config: dict, device: torch.device, i: int) -> torch.Tensor:
    b, caches, scale, out = _attention_inputs(p, device)
    kc, vc = caches[i]
    return paged_attention.paged_attention(
        b.q, kc, vc, b.block_tables, b.query_start_loc, b.context_lens,
        p["head_dim"] ** -0.5, max_query_len=b.max_query_len,
        max_context_len=b.max_context_len, k_scale=scale, v_scale=scale, out=out,
        config=config, **b.kwargs())


PAGED_ATTENTION = Tunable(
    name="paged_attention", problems=_attention_problems, key=_attention_key,
    candidates=_attention_candidates,
    default=lambda p: paged_attention.default_config(p["head_dim"], _attention_class(p),
                                                     _kv_fp8(p)),
    run=lambda p, c, d: _attention_call(p, c, d, 0).clone(),
    bench=lambda p, c, d: time_cuda(lambda i: _attention_call(p, c, d, i), d,
                                    len(_attention_inputs(p, d)[1])),
    release=_release,
)


def _gemv_problems(t: TuneTarget) -> list[dict]:
    """The model's linears at M=1: qkv, o_proj, gate_up, down (FP8 when the engine's
    weights are) and lm_head (FP8 with ``--quantize-lm-head``). bf16/fp16 engines only
    (gemv's dtypes)."""
    if t.dtype not in (torch.bfloat16, torch.float16):
        return []
    m = t.model
    dt = str(t.dtype).removeprefix("torch.")
    w = "fp8" if t.weights_fp8 else dt
    shapes = [(m.q_size + 2 * m.kv_size, m.hidden_size, w), (m.hidden_size, m.q_size, w),
              (2 * m.intermediate_size, m.hidden_size, w),
              (m.hidden_size, m.intermediate_size, w),
              (m.vocab_size, m.hidden_size, "fp8" if t.lm_head_fp8 else dt)]
    return [{"m": 1, "n": n, "k": k, "dtype": dt, "weight": wd}
            for n, k, wd in dict.fromkeys(shapes)]


def _gemv_inputs(p: dict, device: torch.device) -> tuple:
    def make() -> tuple:
        dtype = torch_dtype(p["dtype"])
        x = torch.randn(p["m"], p["k"], device=device).to(dtype)
        w = torch.randn(p["n"], p["k"], device=device) * p["k"] ** -0.5
        fp8 = p["weight"] == "fp8"
        w = w.to(torch.float8_e4m3fn) if fp8 else w.to(dtype)
        scale = torch.full((), 0.01, device=device) if fp8 else None
        nbytes = w.numel() * w.element_size()
        return x, [w] + [w.clone() for _ in range(_copies(nbytes) - 1)], scale

    return _cached(p, device, make)


def _gemv_call(p: dict, c: dict, d: torch.device, i: int) -> torch.Tensor:
    x, ws, scale = _gemv_inputs(p, d)
    return gemv.gemv(x, ws[i], scale, config=c)


GEMV = Tunable(
    name="gemv", problems=_gemv_problems,
    key=lambda p: gemv_configs.tuning_key(p["m"], p["n"], p["k"], p["weight"]),
    candidates=lambda p: [dict(c, SPLIT_K=s) for c in gemv_configs.GEMV_CONFIGS
                          for s in gemv_configs.split_candidates(p["n"], p["k"], c)],
    default=lambda p: gemv_configs.default_config(p["m"], p["n"], p["k"], p["weight"] == "fp8"),
    run=lambda p, c, d: _gemv_call(p, c, d, 0),
    bench=lambda p, c, d: time_cuda(lambda i: _gemv_call(p, c, d, i), d,
                                    len(_gemv_inputs(p, d)[1])),
    release=_release,
)

BUILTINS: tuple[Tunable, ...] = (PAGED_ATTENTION, GEMV)
