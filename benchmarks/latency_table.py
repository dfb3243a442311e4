"""Batch-1 decode against the bandwidth floor, preset by preset, on one GPU: random bf16 engines
(`kiln build random:P --no-tune --no-precompile-kernels --max-seq-len 2048`; tiny presets
need --max-seq-len 512), each timed by
`kiln bench latency E --batch-size B --input-len 128 --output-len 256 --num-iters 5`.

The floor is the weight bytes read once per token (2 bytes a parameter; an untied embedding
matrix is not counted, a decode reads one row of it) over the card's bandwidth: 3.35 TB/s on
an H100, 4.23 TB/s (measured copy) on an H200; another card prints no floor.

usage: python benchmarks/latency_table.py [--out DIR] [--presets qwen2.5-0.5b,...]
       [--batch-sizes 1,8] [--time-limit SECONDS] [--max-seq-len 2048]"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PRESETS = "qwen2.5-0.5b,llama-3.2-1b,qwen2.5-1.5b,qwen2.5-7b,llama-3-8b"
BANDWIDTH_TBS = {"H100": 3.35, "H200": 4.23}


def floor_ms(params: int, device_name: str) -> float | None:
    """Milliseconds to read ``params`` bf16 weights at the card's bandwidth, or None."""
    tbs = next((v for k, v in BANDWIDTH_TBS.items() if k in device_name), None)
    return None if tbs is None else params * 2 / (tbs * 1e12) * 1e3


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("latency-table"))
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--time-limit", type=float, default=float("inf"))
    ap.add_argument("--max-seq-len", type=int, default=2048)
    a = ap.parse_args(argv)
    from kiln.sources.random import PRESETS as KNOWN

    presets = [p for p in a.presets.split(",") if p]
    unknown = sorted(set(presets) - set(KNOWN))
    if unknown:
        raise SystemExit(f"--presets {unknown}: choose from {sorted(KNOWN)}")
    sizes = [int(b) for b in a.batch_sizes.split(",") if b]
    a.out.mkdir(parents=True, exist_ok=True)
    start, rows, skipped, device = time.monotonic(), [], [], "?"
    for preset in presets:
        if time.monotonic() - start > a.time_limit:
            skipped.append(preset)
            continue
        engine = a.out / f"engine-{preset}"
        if not (engine / "engine.json").is_file():
            subprocess.run([sys.executable, "-m", "kiln", "build", f"random:{preset}", "-o",
                            str(engine), "--dtype", "bfloat16", "--no-tune",
                            "--no-precompile-kernels", "--max-seq-len", str(a.max_seq_len)],
                           check=False)
        if not (engine / "engine.json").is_file():
            print(f"latency_table: {preset} did not build; its rows are left out", flush=True)
            continue
        for b in sizes:
            out = a.out / f"latency-{preset}-b{b}.json"
            code = subprocess.run([sys.executable, "-m", "kiln", "bench", "latency", str(engine),
                                   "--batch-size", str(b), "--input-len", "128", "--output-len",
                                   "256", "--num-iters", "5", "--json", str(out)],
                                  check=False).returncode
            if code:
                print(f"latency_table: {preset} batch {b} failed (exit {code})", flush=True)
                continue
            d = json.loads(out.read_text())
            cfg = KNOWN[preset]
            params = cfg.num_params - (0 if cfg.tie_word_embeddings
                                       else cfg.vocab_size * cfg.hidden_size)
            tpot = d["tpot_s"]["median"] * 1e3
            floor = floor_ms(params, d["environment"].get("device_name", "")) if b == 1 else None
            frac = f"{floor / tpot:.0%}" if floor else ""
            rows.append(f"| {preset} | {b} | {tpot:.3f} | {params * 2 / 1e9:.2f} | "
                        f"{f'{floor:.3f}' if floor else ''} | {frac} |")
            device = d["environment"].get("device_name", device)
    print(f"\nrandom bf16 engines, 128 in / 256 out, median TPOT of 5 runs ({device})")
    print("| preset | batch | TPOT ms | weight GB | floor ms | fraction |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if skipped:
        print(f"skipped (past --time-limit {a.time_limit:.0f} s): {', '.join(skipped)}")


if __name__ == "__main__":
    main(sys.argv[1:])
