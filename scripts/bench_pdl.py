"""Programmatic dependent launch A/B on the GPU: KILN_PDL 0 (off) / 1 (PDL) / 2 (PDL + the
GEMV's first-tile prefetch), one engine per mode in one process.

    KILN_CACHE=... PYTHONPATH=. python3 scripts/bench_pdl.py [--only 8b,smol] [--out r.json]

``--knob gemv.PREFETCH_HINT_BYTES=32,128`` A/Bs any integer rule of the gemv or
paged_attention module (repeatable; all combinations run). ``--mid-m 0,1`` also A/Bs gemv's tensor-core tiles for 9-128 rows (``gemv.MID_M``, the
speculative steps' GEMMs on small weights) against cuBLAS, and ``--silu-max-k 4096,16384``
the SiLU-and-mul prologue on llama-3-8b's down projection, and ``--norm-prologue 0,1`` the
add + RMSNorm folded into the next GEMV at batch 1; with the real smollm2 GGUF each
variant also runs plain vs lookahead (7,7,7) on the bundled code and chat prompts.

Per model and mode: the CUDA-graph replay time of the batch-1 and batch-8 decode buckets (and
the lookahead (7,7,7) masked batch-1 bucket on smollm2), batch-1 decode tokens/s (128 in /
128 out, greedy, async scheduling), and whether the greedy tokens equal mode 0's (PDL changes
when kernels start, never what they compute: any difference is a race). Engines are built
from random weights (llama-3-8b bf16 and FP8, smollm2-135m bf16 with lookahead) unless the
smollm2 GGUF is in $KILN_CACHE. Benchmarks, not tests; prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_fast_path import build_smol, free  # scripts/ is on sys.path as a script

from kiln.builder import QuantConfig, build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.kernels import _pdl, gemv, paged_attention
from kiln.runtime.models import llama
from kiln.runtime.sampling_params import SamplingParams

ROWS: list[tuple[str, str]] = []


MODULES = {"gemv": gemv, "paged_attention": paged_attention, "llama": llama}  # --knob targets


def _rule(name: str) -> tuple[object, str]:
    """``"gemv.MID_M"`` -> (the gemv module, "MID_M")."""
    mod, _, attr = name.partition(".")
    return MODULES[mod], attr


@contextlib.contextmanager
def kernel_knobs(knobs: dict):
    """Set kernel-module rules ({"gemv.MID_M": 1, ...}) inside the block, then restore."""
    old = {k: getattr(*_rule(k)) for k in knobs}
    for k, v in knobs.items():
        setattr(*_rule(k), v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(*_rule(k), v)


def one_mode(path: Path, mode: int, prompt: list[int], knobs: dict,
             lookahead: bool = False) -> dict:
    with _pdl.forced(mode), kernel_knobs(knobs):
        t0 = time.perf_counter()
        eng = LLMEngine.from_engine_dir(path, RuntimeConfig(device="cuda", max_num_seqs=8))
        load_s = time.perf_counter() - t0
        runner = eng.runner.graphs
        replays = {}
        for b in sorted(runner.graphs, key=lambda b: (b.masked, b.num_seqs)):
            if b.num_seqs in (1, 8):
                name = f"S={b.num_seqs} T={b.num_tokens}" + (" masked" if b.masked else "")
                replays[name] = runner.replay_ms(b, 50)
        plain = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True,
                               lookahead=(1, 1, 0))
        eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                              lookahead=(1, 1, 0)))
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = eng.generate([prompt], plain)[0]
        torch.cuda.synchronize()
        tps = len(out.token_ids) / (time.perf_counter() - t)
        tokens = list(out.token_ids)
        la_tokens, la_steps = None, None
        if eng.speculative.mode != "none":  # greedy lookahead: must not move with the mode
            la = eng.generate([prompt], SamplingParams(max_tokens=128, temperature=0,
                                                       ignore_eos=True))[0]
            la_tokens, la_steps = list(la.token_ids), la.metrics.spec_steps
        spec = None
        if lookahead:  # plain vs (7,7,7) on the bundled code and chat prompts
            from kiln.bench.speculative import run_speculative_latency

            spec = run_speculative_latency(eng, output_len=256, prompts_per_set=3,
                                          repeats=2)["sets"]
        del eng, runner
    free()
    return {"replay_ms": replays, "tok_s": tps, "tokens": tokens, "load_s": load_s,
            "lookahead": spec, "la_tokens": la_tokens, "la_steps": la_steps}


def compare(res: dict, name: str, path: Path, modes: list[int], knob_values: dict,
            lookahead: bool = False) -> None:
    """Every PDL mode x knob combination on one engine dir, keyed ``{mode}[-ATTR=value]...``
    (a knob at its shipped value adds nothing to the key)."""
    prompt = list(range(1000, 1128))
    r = res.setdefault(name, {})
    keys = []
    names = list(knob_values)
    for combo in itertools.product(*(knob_values[n] for n in names)):
        knobs = dict(zip(names, combo))
        for m in modes:
            key = str(m) + "".join(
                f"-{n.split('.')[1]}={v}" for n, v in knobs.items() if v != getattr(*_rule(n)))
            r[key] = one_mode(path, m, prompt, knobs, lookahead)
            keys.append(key)
    first = keys[0]
    for key in keys:
        x = r[key]
        same = x["tokens"] == r[first]["tokens"]
        reps = ", ".join(f"{k} {v:.3f}" for k, v in x["replay_ms"].items())
        row = (f"{x['tok_s']:.1f} tok/s b1, replay ms: {reps}; tokens == {first}: {same}; "
               f"load {x['load_s']:.1f} s")
        if x["la_tokens"] is not None:
            row += (f"; lookahead tokens == {first}: {x['la_tokens'] == r[first]['la_tokens']}"
                    f" ({x['la_steps']} spec steps)")
        for set_name, sp in (x["lookahead"] or {}).items():
            row += (f"; {set_name} lookahead x{sp['speedup']:.2f} ({sp['plain_tokens_per_s']:.0f}"
                    f" -> {sp['spec_tokens_per_s']:.0f}, {sp['tokens_per_step']:.2f} tok/step)")
        ROWS.append((f"{name} KILN_PDL={key}", row))
        print(ROWS[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="8b,smol")
    ap.add_argument("--modes", default="0,1,2", help="KILN_PDL modes to A/B")
    ap.add_argument("--mid-m", help="gemv.MID_M values to A/B, e.g. 0,1")
    ap.add_argument("--silu-max-k", help="gemv.SILU_FUSION_MAX_K values to A/B, e.g. "
                    "4096,16384 (bf16 weights; FP8 at one row always fuse)")
    ap.add_argument("--norm-prologue", help="gemv.NORM_PROLOGUE values to A/B, e.g. 0,1")
    ap.add_argument("--knob", action="append", default=[], metavar="MODULE.ATTR=V1,V2",
                    help="any integer rule of kiln.runtime.kernels.{gemv,paged_attention} "
                    "to A/B, e.g. gemv.PREFETCH_HINT_BYTES=32,128 (repeatable)")
    ap.add_argument("--quants", default="fp8,bf16", help="llama-3-8b weights to run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    modes = [int(m) for m in args.modes.split(",")]
    knob_values: dict[str, list[int]] = {}
    for attr, raw in (("gemv.MID_M", args.mid_m), ("gemv.SILU_FUSION_MAX_K", args.silu_max_k),
                      ("gemv.NORM_PROLOGUE", args.norm_prologue)):
        if raw:
            knob_values[attr] = [int(v) for v in raw.split(",")]
    for spec in args.knob:
        attr, _, raw = spec.partition("=")
        mod, _, name = attr.partition(".")
        if mod not in MODULES or not hasattr(MODULES[mod], name) or not raw:
            ap.error(f"--knob {spec!r}: want MODULE.ATTR=V1,V2 with MODULE one of "
                     f"{sorted(MODULES)} and ATTR one of its rules")
        knob_values[attr] = [int(v) for v in raw.split(",")]
    res: dict = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                 "pdl_supported": _pdl.supported()}
    tmp = Path(tempfile.mkdtemp())
    only = args.only.split(",")
    if "8b" in only:
        for quant in args.quants.split(","):
            out = tmp / f"l3-{quant}"
            build_engine("random:llama-3-8b", out, dtype="bfloat16", max_seq_len=2048,
                         max_num_tokens=8192, max_batch_size=8, progress=False,
                         quantization=QuantConfig(weights="fp8") if quant == "fp8" else None)
            compare(res, f"llama-3-8b {quant}", out, modes, knob_values)
    if "smol" in only:
        source, out = build_smol(tmp, max_batch_size=8)
        compare(res, f"smollm2 ({source})", out, modes, knob_values,
                lookahead=source == "smollm2-135m")
    print(f"\n{res['card']}, PDL supported: {res['pdl_supported']}")
    for a, b in ROWS:
        print(f"| {a} | {b} |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
