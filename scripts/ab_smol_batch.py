"""smollm2-135m decode graph replays (S=1, S=64, dummy inputs) and plain decoding tok/s at
batch 1 and 64 (``bench_fast_path.decode_tps``: 64 copies of one chat prompt, 256 new tokens,
prefill included) with module switches flipped, one engine per variant in one process, each
variant ``--repeats`` times in alternating order (so the spread shows the noise). Random
weights unless the GGUF is in $KILN_CACHE. A benchmark, not a test.

    PYTHONPATH=.:scripts python3 scripts/ab_smol_batch.py [--variants base,torch_ends,...]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from pathlib import Path

import torch
from ablate_step import PATCHES, patched  # scripts/ is on sys.path when run as a script
from bench_fast_path import build_smol, decode_tps, load

from kiln.bench.prompts import CHAT_PROMPTS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base,torch_ends,no_staged_early,no_kv_prefetch")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    source, path = build_smol(Path(tempfile.mkdtemp()), max_batch_size=64)
    rows = []
    for rep in range(args.repeats):
        for name in args.variants.split(","):
            with patched(PATCHES[name]):
                eng = load(path, "fast")
                prompt = eng.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[0]}])
                g = eng.runner.graphs
                replay = {b.num_seqs: statistics.median(g.replay_ms(b, iters=30)
                                                        for _ in range(3))
                          for b in g.buckets if b.num_seqs in (1, 64) and not b.masked}
                b1 = decode_tps(eng, prompt, 1, 256)
                b64 = decode_tps(eng, prompt, 64, 256)
                rows.append((name, rep, b1, b64, replay.get(1, 0.0), replay.get(64, 0.0)))
                print(f"{name} #{rep}: b1 {b1:.0f}, b64 {b64:.0f} tok/s, replay {replay}",
                      flush=True)
                del eng
                gc.collect()
                torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, smollm2 ({source}) plain decoding, tok/s")
    print("| variant | run | batch 1 | batch 64 | replay ms S=1 | replay ms S=64 |")
    print("|---|---|---|---|---|---|")
    for name, rep, b1, b64, r1, r64 in rows:
        print(f"| {name} | {rep} | {b1:.0f} | {b64:.0f} | {r1:.3f} | {r64:.3f} |")


if __name__ == "__main__":
    main()
