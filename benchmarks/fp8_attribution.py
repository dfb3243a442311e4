"""Where FP8 loses a model's quality: perplexity on the built-in eval set with each part of
the FP8 scheme emulated alone and together, in float32 on the CPU (or CUDA).

The model is the source's transformers model (built-in GGUF sources through kiln's reader).
Every linear layer of the decoder (not the embeddings, not lm_head: `kiln quantize` keeps
those) gets its weight rounded through e4m3 with a per-tensor or a per-output-channel scale
(amax / 448), and its input with a static per-tensor scale (the amax over the calibration
chunks, as modelopt's max calibration takes it) or a dynamic per-token one. The KV cache is
emulated on the keys after RoPE and the values, per-tensor static per layer (calibrated
amax), as kiln stores them (``kv``; ``k`` or ``v`` alone; ``kv_head``: a static scale per KV
head). Rounding: x -> (x / s).clamp(+-448).to(e4m3) * s.

usage: python benchmarks/fp8_attribution.py [SOURCE=qwen2.5-coder-1.5b] [VARIANTS=all]
       [--seq-len 512] [--calib-size 13] [--calib-seq-len 256]

VARIANTS is a comma list of VARIANTS' names (all: every one), or of their parts joined by '+'
(``w_tensor+a_token``: per-tensor weights, per-token activations)."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from typing import Any

import torch

E4M3_MAX = 448.0
VARIANTS = ("fp32", "w_tensor", "w_channel", "w_tensor+a_static", "w_channel+a_token", "kv",
            "k", "v", "kv_head", "w_tensor+a_static+kv", "w_channel+a_token+kv",
            "w_tensor+a_static+v", "w_channel+a_token+v")


def fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` through e4m3 at ``scale`` (broadcast), back in x's dtype."""
    s = scale.clamp(min=1e-12)
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s


def decoder_linears(model: Any) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in n}


def calibrate(model: Any, chunks: list[list[int]], device: str) -> dict[str, float]:
    """Per linear layer, the amax of its input; per attention layer, of its keys after RoPE
    (``<attn>.k``) and its values (``<attn>.v``): the max over the calibration chunks."""
    amax: dict[str, Any] = {}

    def note(name: str, t: torch.Tensor, dims: tuple[int, ...] | None = None) -> None:
        m = t.detach().abs().amax(dim=dims) if dims else t.detach().abs().max()
        amax[name] = torch.maximum(amax[name], m) if name in amax else m

    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: note(n, args[0]))
             for n, m in decoder_linears(model).items()]
    def kv(layer: int, k: torch.Tensor, v: torch.Tensor):  # [B, KVH, T, D]
        for name, t in ((f"{layer}.k", k), (f"{layer}.v", v)):
            note(name, t)
            note(name + ".head", t, (0, 2, 3))
        return k, v

    with kv_hook(model, kv), torch.no_grad():
        for c in chunks:
            model(torch.tensor([c], device=device), use_cache=False)
    for h in hooks:
        h.remove()
    return amax


@contextlib.contextmanager
def kv_hook(model: Any, fn):
    """Call ``fn(layer_index, k, v) -> (k, v)`` on each attention layer's keys (after RoPE)
    and values before attention reads them (transformers' eager attention of the model's
    module, llama / qwen2 alike)."""
    import importlib

    mod = importlib.import_module(type(model).__module__)
    real = mod.eager_attention_forward

    def eager(module, query, key, value, *a, **kw):
        key, value = fn(module.layer_idx, key, value)
        return real(module, query, key, value, *a, **kw)

    impl = model.config._attn_implementation
    mod.eager_attention_forward = eager
    model.config._attn_implementation = "eager"
    try:
        yield
    finally:
        mod.eager_attention_forward = real
        model.config._attn_implementation = impl


@contextlib.contextmanager
def emulate(model: Any, variant: str, amax: dict[str, float]):
    """The model with ``variant``'s FP8 emulation in place (weights restored after)."""
    parts = set(variant.split("+"))
    saved, hooks = {}, []
    lin = decoder_linears(model)
    with torch.no_grad():
        for n, m in lin.items():
            w = m.weight
            if "w_tensor" in parts:
                saved[n] = w.detach().clone()
                w.copy_(fp8_round(w, w.abs().max() / E4M3_MAX))
            elif "w_channel" in parts:
                saved[n] = w.detach().clone()
                w.copy_(fp8_round(w, w.abs().amax(dim=1, keepdim=True) / E4M3_MAX))
    for n, m in lin.items():
        if "a_static" in parts:
            s = amax[n] / E4M3_MAX
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, s=s: (fp8_round(args[0], s),)))
        elif "a_token" in parts:
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args: (fp8_round(args[0], args[0].abs().amax(-1, keepdim=True)
                                             / E4M3_MAX),)))
    ctx = contextlib.nullcontext()
    which = {"kv": ("k", "v"), "k": ("k",), "v": ("v",), "kv_head": ("k", "v")}
    rounded = [t for p in parts for t in which.get(p, ())]
    if rounded:
        per = ".head" if "kv_head" in parts else ""

        def kv(layer, k, v):
            def r(name, t):
                if name not in rounded:
                    return t
                s = amax[f"{layer}.{name}{per}"] / E4M3_MAX
                return fp8_round(t, s[None, :, None, None] if per else s)
            return r("k", k), r("v", v)
        ctx = kv_hook(model, kv)
    try:
        with ctx:
            yield
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for n, w in saved.items():
                lin[n].weight.copy_(w)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("variants", nargs="?", default="all")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calib-size", type=int, default=13)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    variants = VARIANTS if a.variants == "all" else tuple(a.variants.split(","))
    parts = {p for v in VARIANTS for p in v.split("+")}
    unknown = {v for v in variants if not set(v.split("+")) <= parts}
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS} or "
                         f"join any of {sorted(parts)} with '+'")

    from kiln.quantize.calib import calibration_chunks, eval_windows, load_text_set
    from kiln.quantize.modelopt_fp8 import _load_hf_model
    from kiln.quantize.quality import hf_perplexity

    t0 = time.perf_counter()
    model, source, _ = _load_hf_model(a.source, a.device, progress=False)
    model.float()
    tok = source.tokenizer
    windows = eval_windows(tok, load_text_set(None, "eval"), a.seq_len)
    chunks = calibration_chunks(tok, load_text_set(None, "calib"), a.calib_size,
                                a.calib_seq_len)
    amax = calibrate(model, chunks, a.device)
    n_tok = sum(len(w) - 1 for w in windows)
    print(f"{a.source}: {n_tok:,} eval tokens in {len(windows)} windows of {a.seq_len}; "
          f"{len(chunks)} calibration chunks; loaded + calibrated in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    base = None
    for v in variants:
        t0 = time.perf_counter()
        with emulate(model, v, amax):
            ppl = hf_perplexity(model, windows, a.device)
        base = ppl if v == "fp32" else base
        rel = f" ({ppl / base - 1:+.1%})" if base and v != "fp32" else ""
        print(f"{v:24s} perplexity {ppl:8.3f}{rel}   [{time.perf_counter() - t0:.0f} s]",
              flush=True)
    if not math.isfinite(base or 0.0):
        raise SystemExit("the float32 perplexity is not finite")


if __name__ == "__main__":
    main(sys.argv[1:])
