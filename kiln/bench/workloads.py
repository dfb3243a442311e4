"""TensorRT-LLM's published throughput workloads, run by name, with its numbers beside kiln's.

Source: docs/source/performance/perf-overview.md in NVIDIA/TensorRT-LLM (read at commit
00f37686aa85). Its "Reproducing Benchmarked Results" table gives the request count of each
input/output length (more requests for short sequences, so the run reaches a steady state);
its "Llama 3.1 8B" table gives Total Output Throughput (tokens/s) of
nvidia/Llama-3.1-8B-Instruct-FP8 (ModelOpt) at TP1 on an H100 SXM 80GB and an H200 SXM 141GB,
measured with ``trtllm-bench throughput`` (PyTorch backend): prompts of random token ids of
exactly the input length, exactly the output length generated, all requests queued at once.
kiln runs the same shape of workload: random prompts, EOS ignored, everything queued at once.
The page's tenth row, 20000/2000, is left out: it needs an engine of max_seq_len 22000.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifact import ENGINE_JSON
from kiln.artifact.spec import Limits
from kiln.bench.offline import BenchRequest, ProgressFn, run_throughput, synthetic_requests

# progress(label, total) -> a context manager yielding the ProgressFn of one workload's run
WorkloadProgress = Callable[[str, int], AbstractContextManager[ProgressFn]]

# A throughput run needs this many requests per running sequence: the batch fills, drains and
# refills several times, so the start and the tail are a small part of the wall time.
MIN_REQUESTS_PER_SEQ = 4
PUBLISHED_MODEL = "nvidia/Llama-3.1-8B-Instruct-FP8"
PUBLISHED_CARDS = ("H100", "H200")


@dataclass(frozen=True)
class Workload:
    """One published workload: fixed prompt and output lengths, the number of requests
    TensorRT-LLM ran, and its output tokens/s for Llama-3.1-8B FP8 on one H100 / one H200."""

    input_len: int
    output_len: int
    num_requests: int
    h100_tokens_per_s: float
    h200_tokens_per_s: float

    @property
    def name(self) -> str:
        return f"{self.input_len}/{self.output_len}"

    @property
    def seq_len(self) -> int:
        return self.input_len + self.output_len

    def published(self, card: str) -> float:
        """TensorRT-LLM's output tokens/s on ``card`` (one of PUBLISHED_CARDS)."""
        return self.h200_tokens_per_s if card == "H200" else self.h100_tokens_per_s


# perf-overview.md's rows in its Llama 3.1 8B table's order.
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload(128, 128, 30000, 28_312, 27_911),
    Workload(128, 2048, 3000, 22_714, 26_221),
    Workload(128, 4096, 1500, 14_325, 18_027),
    Workload(500, 2000, 3000, 17_660, 20_770),
    Workload(1000, 1000, 3000, 15_220, 17_744),
    Workload(1000, 2000, 1500, 13_899, 16_828),
    Workload(2048, 128, 3000, 3_450, 3_538),
    Workload(2048, 2048, 1500, 9_305, 12_194),
    Workload(5000, 500, 1500, 3_459, 3_902),
)}


def parse_workloads(names: Sequence[str]) -> list[Workload]:
    """``--workload`` values (repeated and/or comma separated; ``all``) -> workloads in the
    order given, each once."""
    chosen: list[Workload] = []
    for name in (n.strip() for text in names for n in text.split(",")):
        if not name:
            continue
        found = list(WORKLOADS.values()) if name == "all" else [WORKLOADS.get(name)]
        if found == [None]:
            raise ValueError(
                f"--workload {name!r} is not one of TensorRT-LLM's published workloads "
                f"(input/output tokens): {', '.join(WORKLOADS)}, or all")
        chosen += [w for w in found if w not in chosen]
    if not chosen:
        raise ValueError(f"--workload names no workload; use one of: {', '.join(WORKLOADS)}, "
                         "or all")
    return chosen


def engine_limits(engine_dir: str | Path) -> Limits:
    """An engine's Limits, read from its engine.json without loading the engine."""
    return Limits.from_dict(json.loads((Path(engine_dir) / ENGINE_JSON).read_text())["limits"])


def check_engine(workloads: Sequence[Workload], num_prompts: int | None,
                 limits: Limits) -> None:
    """Refuse, before the engine loads, a request count too small for the engine's batch
    and workloads longer than the engine's sequences."""
    if num_prompts is not None:
        least = MIN_REQUESTS_PER_SEQ * limits.max_batch_size
        if num_prompts < least:
            raise ValueError(
                f"--num-prompts {num_prompts} is below {MIN_REQUESTS_PER_SEQ} x the engine's "
                f"max_batch_size {limits.max_batch_size} = {least}: a throughput run needs "
                f"at least {MIN_REQUESTS_PER_SEQ} requests per running sequence to reach a "
                f"steady state; pass --num-prompts {least} or more, or leave it out to run "
                "TensorRT-LLM's request counts")
    too_long = [w for w in workloads
                if w.seq_len > limits.max_seq_len or w.input_len > limits.max_input_len]
    if too_long:
        fits = [w.name for w in WORKLOADS.values()
                if w.seq_len <= limits.max_seq_len and w.input_len <= limits.max_input_len]
        need = max(w.seq_len for w in too_long)
        raise ValueError(
            f"workload{'s' if len(too_long) > 1 else ''} "
            f"{', '.join(w.name for w in too_long)} "
            f"{'do' if len(too_long) > 1 else 'does'} not fit the engine's "
            f"max_seq_len {limits.max_seq_len} (max_input_len {limits.max_input_len}): "
            f"prompt + output must fit one sequence; rebuild with --max-seq-len {need} or "
            "more" + (f", or run only workloads that fit: {', '.join(fits)}" if fits else ""))


def card_of(device_name: str | None) -> str:
    """The published column to print beside a run on ``device_name``: H200 on an H200,
    else H100 (the card the comparison is usually made on)."""
    return "H200" if device_name and "H200" in device_name.upper() else "H100"


def is_published_model(engine: Any) -> bool:
    """Whether the engine has Llama-3.1-8B's shape and runs on one GPU (the published
    setting), so that kiln / TensorRT-LLM compares like with like (weights and dtype aside)."""
    from kiln.sources.random import PRESETS

    spec = getattr(engine, "spec", None)
    model = getattr(spec, "model", None)
    ref = PRESETS["llama-3-8b"]
    fields = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
              "num_heads", "num_kv_heads", "head_dim")
    return (model is not None and getattr(spec, "tp", 1) == 1
            and all(getattr(model, f, None) == getattr(ref, f) for f in fields))


def run_workloads(
    engine: Any,
    workloads: Sequence[Workload],
    num_prompts: int | None = None,
    seed: int = 0,
    *,
    device_name: str | None = None,
    progress: WorkloadProgress | None = None,
) -> dict:
    """Run each workload as an offline throughput benchmark (random prompts, EOS ignored,
    all requests queued at once) and put TensorRT-LLM's number beside it.

    ``num_prompts`` replaces every workload's published request count. ``progress(label,
    total)`` returns a context manager yielding a ProgressFn for that workload's tokens.
    Returns the throughput result with one record per workload under ``workloads``.
    """
    card = card_of(device_name)
    compare = is_published_model(engine)
    records = []
    for w in workloads:
        n = num_prompts or w.num_requests
        requests = synthetic_requests(engine, n, w.input_len, w.output_len, seed)
        records.append(_record(w, _run(engine, requests, w, seed, progress), card, compare))
    return {
        "benchmark": "throughput",
        "config": {
            "source": "TensorRT-LLM workloads",
            "workloads": ", ".join(w.name for w in workloads),
            "num_prompts": num_prompts,
            "seed": seed,
        },
        "reference": {
            "model": PUBLISHED_MODEL, "card": card, "tp": 1, "tool": "trtllm-bench throughput",
            "source": "NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md",
            "ratio_shown": compare,
        },
        "workloads": records,
    }


def _run(engine: Any, requests: list[BenchRequest], w: Workload, seed: int,
         progress: WorkloadProgress | None) -> dict:
    if progress is None:
        return run_throughput(engine, requests=requests, seed=seed)
    with progress(f"{w.name} x {len(requests)}",
                  sum(r.output_len for r in requests)) as advance:
        return run_throughput(engine, requests=requests, seed=seed, progress=advance)


def _record(w: Workload, r: dict, card: str, compare: bool) -> dict:
    """One workload's line of the report: kiln's numbers, TensorRT-LLM's, the ratio."""
    published = w.published(card)
    return {
        "workload": w.name,
        "input_len": w.input_len,
        "output_len": w.output_len,
        "num_requests": r["num_requests"],
        "published_num_requests": w.num_requests,
        **{k: r[k] for k in ("prompt_tokens", "output_tokens", "elapsed_s", "num_steps",
                             "num_preemptions", "requests_per_s", "output_tokens_per_s",
                             "total_tokens_per_s", "ttft_s", "tpot_s")},
        "trtllm_output_tokens_per_s": {c: w.published(c) for c in PUBLISHED_CARDS},
        "ratio": r["output_tokens_per_s"] / published if compare else None,
    }
