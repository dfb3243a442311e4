"""End-to-end GPU numbers for the notes: smollm2-135m bf16, batch 1 decode and plain vs
lookahead, per attention backend, with plain transformers in the same run.

    KILN_CACHE=... PYTHONPATH=. python3 scripts/bench_e2e.py [--out FILE.json]

Needs the smollm2 GGUF in $KILN_CACHE (see GPU.md for carrying it). Benchmarks, not tests.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kiln.bench.prompts import CODE_PROMPTS
from kiln.bench.speculative import run_speculative_latency
from kiln.builder import build_engine
from kiln.builder.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.sources.builtin import fetch_builtin

NEW_TOKENS = 256


def decode_tps(engine: LLMEngine, prompt: list[int], batch: int) -> float:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                            lookahead=(1, 1, 0))
    engine.generate([prompt] * batch, SamplingParams(max_tokens=8, temperature=0,
                                                     lookahead=(1, 1, 0)))  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate([prompt] * batch, params)
    torch.cuda.synchronize()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def hf_tps(prompt: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    gguf = fetch_builtin("smollm2-135m", progress=False)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.tensor([prompt], device="cuda")
    kw = dict(do_sample=False, min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS,
              pad_token_id=0)
    model.generate(ids, **{**kw, "min_new_tokens": 8, "max_new_tokens": 8})
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    return NEW_TOKENS / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--window", default="7,7,7")
    args = ap.parse_args()
    out_dir = Path(tempfile.mkdtemp()) / "smol-bf16"
    build_engine("smollm2-135m", out_dir, dtype="bfloat16", max_seq_len=1024,
                 max_num_tokens=4096, max_batch_size=64, progress=False,
                 speculative=SpeculativeConfig.from_cli("lookahead", args.window, None, None))
    results: dict = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d"), "window": args.window}
    rows = []
    for backend in ("torch", "triton"):
        t0 = time.perf_counter()
        eng = LLMEngine.from_engine_dir(out_dir, RuntimeConfig(device="cuda",
                                                               attention_backend=backend))
        load_s = time.perf_counter() - t0
        prompt = eng.apply_chat_template([{"role": "user", "content": CODE_PROMPTS[0]}])
        b1 = decode_tps(eng, prompt, 1)
        b64 = decode_tps(eng, prompt, 64)
        spec = run_speculative_latency(eng, output_len=128, prompts_per_set=3)
        row = {"backend": backend, "load_s": load_s, "batch1_tok_s": b1, "batch64_tok_s": b64}
        for name, s in spec["sets"].items():
            row[f"{name}_plain_tok_s"] = s["plain_tokens_per_s"]
            row[f"{name}_lookahead_tok_s"] = s["spec_tokens_per_s"]
            row[f"{name}_speedup"] = s["speedup"]
            row[f"{name}_tokens_per_step"] = s["tokens_per_step"]
            row[f"{name}_same_output"] = s["same_output"]
        rows.append(row)
        del eng
        torch.cuda.empty_cache()
    results["kiln"] = rows
    results["hf_eager_batch1_tok_s"] = hf_tps(prompt)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nsmollm2-135m bf16 on {results['card']}, {NEW_TOKENS} new tokens, window "
          f"{args.window}")
    print(f"transformers eager batch 1: {results['hf_eager_batch1_tok_s']:.1f} tok/s")
    for r in rows:
        print(f"kiln[{r['backend']}] load {r['load_s']:.1f}s  batch1 {r['batch1_tok_s']:.1f} "
              f"tok/s  batch64 {r['batch64_tok_s']:.1f} tok/s")
        for name in ("code", "chat"):
            print(f"   {name}: plain {r[name + '_plain_tok_s']:.1f} tok/s, lookahead "
                  f"{r[name + '_lookahead_tok_s']:.1f} tok/s, x{r[name + '_speedup']:.2f}, "
                  f"{r[name + '_tokens_per_step']:.2f} tokens/step, same output "
                  f"{r[name + '_same_output']}")


if __name__ == "__main__":
    main()
