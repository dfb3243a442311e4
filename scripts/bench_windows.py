"""Lookahead engine windows beyond (7,7,7) on smollm2-135m bf16 (the real GGUF): at 135M a
step is launch-bound, so a wider window (more tokens per step) may cost little more GPU time
while accepting more tokens. One engine per window (its own masked graphs); per window: the
masked S=1 replay vs the decode replay, then plain vs lookahead on the code and chat prompts
(kiln.bench.speculative, the same numbers `kiln bench speculative` prints).

    KILN_CACHE=... PYTHONPATH=. python3 scripts/bench_windows.py [--windows "7,7,7;15,5,15"]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_fast_path import build_smol  # scripts/ is on sys.path

from kiln.bench.speculative import run_speculative_latency
from kiln.runtime.engine import LLMEngine, RuntimeConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", default="7,7,7;15,5,15;10,7,10;7,7,15;15,7,15;12,9,12")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res: dict = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                 "windows": {}}
    for w in args.windows.split(";"):
        source, out = build_smol(Path(tempfile.mkdtemp()), max_batch_size=8, window=w)
        if "source" not in res:
            res["source"] = source
            print(f"{res['card']} {res['date']} smollm2-135m bf16 ({source})", flush=True)
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cuda"))
        g = eng.runner.graphs
        dec = next(b for b in g.graphs if b.num_seqs == 1 and not b.masked)
        msk = next(b for b in g.graphs if b.num_seqs == 1 and b.masked)
        row = {"T": msk.num_tokens, "decode_ms": g.replay_ms(dec, 50),
               "masked_ms": g.replay_ms(msk, 50)}
        r = run_speculative_latency(eng, output_len=args.output_len, prompts_per_set=3)
        row["sets"] = {k: {kk: s[kk] for kk in ("plain_tokens_per_s", "spec_tokens_per_s",
                                                "speedup", "tokens_per_step")}
                       for k, s in r["sets"].items()}
        res["windows"][w] = row
        print(f"  ({w}) T={row['T']}: replay decode {row['decode_ms']:.3f} ms, masked "
              f"{row['masked_ms']:.3f} ms; " + "; ".join(
                  f"{k} x{s['speedup']:.2f} ({s['tokens_per_step']:.2f} tok/step, "
                  f"{s['plain_tokens_per_s']:.0f} -> {s['spec_tokens_per_s']:.0f})"
                  for k, s in row["sets"].items()), flush=True)
        del eng, g
        torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
