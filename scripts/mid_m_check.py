"""The MID_M puzzle (gemv.MID_M, notes/NOTES.md 2026-11-30 fourth session): with gemv's
tensor-core tiles on the speculative steps' 9-128-row GEMMs, the graph replays got faster
but lookahead accepted fewer tokens per step (2.30 -> 1.90). Fewer accepted tokens with an
unchanged output is what wrong lookahead-branch rows would do (verification still sees the
right rows). This runs smollm2-135m bf16 with MID_M off and on, CUDA graphs on and off, and
prints per run: tokens per lookahead step, lookahead == plain greedy (same engine), and plain
== the MID_M=0 graphs-on plain output.

    KILN_CACHE=... PYTHONPATH=. python3 scripts/mid_m_check.py [--tokens 128]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from bench_fast_path import build_smol  # scripts/ is on sys.path

from kiln.bench.prompts import CODE_PROMPTS
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.kernels import gemv
from kiln.runtime.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    source, eng_dir = build_smol(Path(tempfile.mkdtemp()), max_batch_size=8)
    print(f"{torch.cuda.get_device_name()}, {source}, lookahead (7,7,7), bf16")
    shipped = gemv.MID_M
    base = None
    for graphs in (True, False):
        for mid in (False, True):
            gemv.MID_M = mid
            try:
                eng = LLMEngine.from_engine_dir(
                    eng_dir, RuntimeConfig(device="cuda", cuda_graphs=graphs))
                prompts = [eng.apply_chat_template([{"role": "user", "content": t}])
                           for t in CODE_PROMPTS[:4]]
                plain = [o.token_ids for o in eng.generate(prompts, [SamplingParams(
                    max_tokens=args.tokens, temperature=0, ignore_eos=True,
                    lookahead=(1, 1, 0))] * len(prompts))]
                spec_steps = spec_tokens = equal = 0
                for p, ref in zip(prompts, plain):  # one at a time: batch 1, as the bench
                    o = eng.generate([p], SamplingParams(max_tokens=args.tokens, temperature=0,
                                                         ignore_eos=True, lookahead=(7, 7, 7)))[0]
                    spec_steps += o.metrics.spec_steps
                    spec_tokens += o.metrics.spec_tokens
                    equal += o.token_ids == ref
                base = base or plain
                same_plain = sum(a == b for a, b in zip(plain, base))
                print(f"graphs={int(graphs)} MID_M={int(mid)}: "
                      f"{spec_tokens / max(spec_steps, 1):.2f} tokens/step, lookahead == plain "
                      f"{equal}/{len(prompts)}, plain == base {same_plain}/{len(prompts)}")
                del eng
                torch.cuda.empty_cache()
            finally:
                gemv.MID_M = shipped


if __name__ == "__main__":
    main()
