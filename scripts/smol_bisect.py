"""Which switch changes smollm2's bf16 greedy output or its batch-64 speed (a bisection aid):
one engine per variant (the bench_fast_path engine: GGUF if cached, max batch 64, (7,7,7)),
greedy plain tokens of one code prompt at batch 1, and batch-64 decode tok/s.

    PYTHONPATH=.:scripts python3 scripts/smol_bisect.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ablate_step import patched  # scripts/ is on sys.path when run as a script
from bench_fast_path import build_smol, decode_tps, free, load

from kiln.runtime.kernels import _pdl, gemv, paged_attention
from kiln.runtime.sampling_params import SamplingParams

VARIANTS = {
    "base": [],
    "no_res_fusion": [(gemv, "RESIDUAL_FUSION", False)],
    "no_staged_early": [(_pdl, "STAGED_EARLY", False)],
    "no_kv_prefetch": [(paged_attention, "KV_PREFETCH_TILES", 0)],
}


def main() -> None:
    source, path = build_smol(Path(tempfile.mkdtemp()), 64)
    print("source", source, flush=True)
    for name, items in VARIANTS.items():
        with patched(items):
            eng = load(path, "fast")
            prompt = eng.apply_chat_template([{"role": "user", "content": "Write a Python "
                                               "function that returns the n-th Fibonacci "
                                               "number iteratively."}])
            out = eng.generate([prompt], SamplingParams(max_tokens=40, temperature=0,
                                                        ignore_eos=True, lookahead=(1, 1, 0)))
            ids = out[0].token_ids
            b64 = decode_tps(eng, prompt, 64, 64) if name == "base" else 0.0
            print(f"{name}: b64 {b64:.0f} tok/s, ids {ids[:40]}", flush=True)
            print(f"   text {eng.tokenizer.decode(ids)[:160]!r}", flush=True)
            del eng
            free()


if __name__ == "__main__":
    main()
