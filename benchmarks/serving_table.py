"""The serving-at-scale table on one GPU: random engines of Llama-3-8B's shape built with kiln's
default limits (bf16, and FP8 weights + FP8 KV cache), each timed at batch 1 (`kiln bench
latency`, 128 in / 256 out) and through TensorRT-LLM's published workloads (`kiln bench
throughput --workload`, which prints the published number beside kiln's); with --steps the
decode and mixed step profiles of benchmarks/serving_step.py on an FP8 engine built with room
for the mixed step's new prompts (batch 512, 16,384 tokens a step, max_seq_len 2,200). The arm
fp8_pc_pt (not run by default) is FP8 with per-channel weights and per-token activations.
--limits runs every arm once per set of build limits instead of at the defaults, for the
token-budget and batch-size choices: --limits "max-num-tokens=4096;max-num-tokens=16384"
(sets split by ';', a set's limits by ',': max-num-tokens, max-batch-size, max-seq-len).

usage: python benchmarks/serving_table.py [--out DIR] [--arms bf16,fp8]
       [--workloads 1000/1000,128/128] [--num-prompts N] [--steps] [--time-limit SECONDS]
       [--source random:llama-3-8b] [--limits "max-batch-size=512;max-batch-size=1024"]

Engines are built with --no-tune --no-precompile-kernels (the measured kernels are the same; the
build takes seconds). --num-prompts defaults to 4x the engine's batch (kiln's lower bound for a
workload run). Each command's JSON goes to DIR; the table (markdown) is printed last. Items that
would start after --time-limit are skipped and listed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BUILD = ["--no-tune", "--no-precompile-kernels"]
ARMS = {"bf16": [], "fp8": ["--quantization", "fp8", "--kv-cache-dtype", "fp8"],
        # per-channel weights, per-token activations (`kiln quantize --qformat fp8_pc_pt`)
        "fp8_pc_pt": ["--quantization", "fp8_pc_pt", "--kv-cache-dtype", "fp8"]}
STEP_LIMITS = ["--max-seq-len", "2200", "--max-num-tokens", "16384", "--max-batch-size", "512"]
LIMITS = ("max-num-tokens", "max-batch-size", "max-seq-len")  # what --limits may set


def limit_flags(limits: str) -> list[str]:
    """``max-num-tokens=4096,max-batch-size=512`` as kiln build flags ("": the defaults)."""
    flags = []
    for item in filter(None, limits.split(",")):
        name, _, value = item.partition("=")
        if name not in LIMITS or not value.isdigit():
            raise SystemExit(f"--limits {item!r}: use NAME=INTEGER with NAME one of "
                             f"{list(LIMITS)}, sets split by ';' and limits by ','")
        flags += [f"--{name}", value]
    return flags


def kiln(*args: str) -> bool:
    """``python -m kiln ARGS``, its output passed through; whether it succeeded (a failure is
    said, and the table goes on without that row)."""
    print(f"$ kiln {' '.join(args)}", flush=True)
    code = subprocess.run([sys.executable, "-m", "kiln", *args], check=False).returncode
    if code:
        print(f"serving_table: `kiln {args[0]}` exited {code}; its row is left out", flush=True)
    return code == 0


def build(source: str, out: Path, name: str, flags: list[str]) -> Path | None:
    """The engine ``out/engine-NAME`` built with ``flags`` (kept if already built)."""
    engine = out / f"engine-{name}"
    if not (engine / "engine.json").is_file():
        kiln("build", source, "-o", str(engine), *flags, *BUILD)
    return engine if (engine / "engine.json").is_file() else None


def arm_key(arm: str, limits: str) -> str:
    """The name of an arm's engine and JSON files at a set of --limits."""
    return arm if not limits else f"{arm}+{limits.replace('=', '').replace(',', '+')}"


def rows_of(arm: str, out: Path, workloads: list[str], limits: str = "") -> list[str]:
    """The table's rows of one arm (at one set of --limits) from the JSON files its runs
    wrote."""
    rows, key = [], arm_key(arm, limits)
    label = f"{arm} ({limits})" if limits else arm
    lat = out / f"latency-{key}.json"
    if lat.is_file():
        d = json.loads(lat.read_text())
        rows.append(f"| {label} | batch 1, 128/256 | 1 | {d['output_tokens_per_s']:,.1f} | "
                    f"{d['tpot_s']['mean'] * 1e3:.2f} | |")
    for w in workloads:
        f = out / f"throughput-{key}-{w.replace('/', '-')}.json"
        if not f.is_file():
            continue
        for r in json.loads(f.read_text())["workloads"]:
            ref = r.get("trtllm_output_tokens_per_s") or {}
            rows.append(f"| {label} | {r['workload']} | {r['num_requests']} | "
                        f"{r['output_tokens_per_s']:,.0f} | {r['tpot_s']['mean'] * 1e3:.2f} | "
                        f"{ref.get('H100', '')} / {ref.get('H200', '')} |")
    return rows


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("serving-table"))
    ap.add_argument("--arms", default="bf16,fp8")
    ap.add_argument("--workloads", default="1000/1000,128/128")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--steps", action="store_true")
    ap.add_argument("--time-limit", type=float, default=float("inf"))
    ap.add_argument("--source", default="random:llama-3-8b")
    ap.add_argument("--limits", default="")
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"--arms {sorted(unknown)}: choose from {sorted(ARMS)}")
    sets = [x.strip() for x in a.limits.split(";") if x.strip()] or [""]
    flags = {limits: limit_flags(limits) for limits in sets}  # checked before anything runs
    workloads = [w for w in a.workloads.split(",") if w]
    a.out.mkdir(parents=True, exist_ok=True)
    start, skipped = time.monotonic(), []

    def due(what: str) -> bool:
        if time.monotonic() - start < a.time_limit:
            return True
        skipped.append(what)
        return False

    for arm in arms:
        for limits in sets:
            key = arm_key(arm, limits)
            if not due(f"{key} build"):
                continue
            engine = build(a.source, a.out, key, ARMS[arm] + flags[limits])
            if engine is None:
                continue
            if due(f"{key} latency"):
                kiln("bench", "latency", str(engine), "--batch-size", "1", "--input-len", "128",
                     "--output-len", "256", "--json", str(a.out / f"latency-{key}.json"))
            batch = json.loads((engine / "engine.json").read_text())["limits"]["max_batch_size"]
            for w in workloads:
                if due(f"{key} {w}"):
                    n = a.num_prompts or 4 * batch
                    kiln("bench", "throughput", str(engine), "--workload", w, "--num-prompts",
                         str(n), "--json",
                         str(a.out / f"throughput-{key}-{w.replace('/', '-')}.json"))
    if a.steps and due("step profiles"):
        engine = build(a.source, a.out, "fp8-steps", ARMS["fp8"] + STEP_LIMITS)
        if engine is not None:
            subprocess.run([sys.executable, str(Path(__file__).with_name("serving_step.py")),
                            str(engine), "256", "1000", "4", "--decode-profile"], check=False)

    print("\n| engine | workload | requests | output tok/s | TPOT ms "
          "| TensorRT-LLM FP8 H100 / H200 |")
    print("|---|---|---|---|---|---|")
    for arm in arms:
        for limits in sets:
            print("\n".join(rows_of(arm, a.out, workloads, limits)))
    if skipped:
        print(f"skipped (past --time-limit {a.time_limit:.0f} s): {', '.join(skipped)}")


if __name__ == "__main__":
    main(sys.argv[1:])
