"""In-process benchmarks on an ``LLMEngine``: offline throughput and batch latency.

Both drive the engine only through its public API (``add_request`` / ``step`` /
``has_unfinished_requests``) and time with ``time.perf_counter`` around ``step()``, so the
numbers include scheduling, sampling and detokenization, as a user of the engine sees them.
Prompts are synthetic random token ids of a fixed length and requests ignore EOS, so every
request produces exactly ``output_len`` tokens (unless a prompt file is given).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.bench.stats import rate, summarize, tpot

# progress(advance) is called with the number of units (tokens or iterations) just done.
ProgressFn = Callable[[int], None]


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: prompt token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


def _vocab_size(engine: Any) -> int:
    """Number of token ids a random prompt may use (model vocab, capped by the tokenizer)."""
    sizes = []
    model = getattr(getattr(engine, "spec", None), "model", None)
    if getattr(model, "vocab_size", None):
        sizes.append(int(model.vocab_size))
    tok = getattr(engine, "tokenizer", None)
    if tok is not None:
        try:
            sizes.append(len(tok))
        except TypeError:
            pass
    if not sizes:
        raise ValueError("cannot tell the engine's vocabulary size (no spec.model.vocab_size)")
    return min(sizes)


def _special_ids(engine: Any) -> set[int]:
    tok = getattr(engine, "tokenizer", None)
    return set(getattr(tok, "all_special_ids", None) or [])


def _limit(engine: Any, name: str) -> int | None:
    value = getattr(getattr(getattr(engine, "spec", None), "limits", None), name, None)
    return int(value) if value else None


def check_lengths(engine: Any, input_len: int, output_len: int) -> None:
    """Raise ValueError when the requested lengths do not fit the engine's limits."""
    if input_len < 1:
        raise ValueError(f"input_len={input_len} must be >= 1")
    if output_len < 1:
        raise ValueError(f"output_len={output_len} must be >= 1")
    max_input = _limit(engine, "max_input_len")
    if max_input is not None and input_len > max_input:
        raise ValueError(
            f"input_len={input_len} exceeds the engine's max_input_len={max_input}; "
            f"use --input-len {max_input} or less, or rebuild with a larger max input length"
        )
    max_seq = _limit(engine, "max_seq_len")
    if max_seq is not None and input_len + output_len > max_seq:
        raise ValueError(
            f"input_len + output_len = {input_len} + {output_len} = {input_len + output_len} "
            f"exceeds the engine's max_seq_len={max_seq}; shorten them or rebuild the engine "
            "with a larger max sequence length"
        )


def synthetic_requests(
    engine: Any, num_prompts: int, input_len: int, output_len: int, seed: int = 0
) -> list[BenchRequest]:
    """``num_prompts`` prompts of exactly ``input_len`` random non-special token ids."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    check_lengths(engine, input_len, output_len)
    vocab = _vocab_size(engine)
    special = _special_ids(engine)
    allowed = [t for t in range(vocab) if t not in special] if special else None
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        if allowed is not None:
            ids = [allowed[rng.randrange(len(allowed))] for _ in range(input_len)]
        else:
            ids = [rng.randrange(vocab) for _ in range(input_len)]
        reqs.append(BenchRequest(ids, output_len))
    return reqs


def sampling_params(output_len: int, temperature: float = 1.0):
    from kiln.runtime.sampling_params import SamplingParams

    # vLLM's benchmark settings: sample at temperature 1, no truncation, run to max_tokens.
    return SamplingParams(max_tokens=output_len, temperature=temperature, top_p=1.0,
                          ignore_eos=True)


def _warmup(engine: Any, input_len: int) -> None:
    """One short request so one-time costs (kernel compilation, graph capture) are not timed."""
    vocab = _vocab_size(engine)
    ids = [random.Random(1234).randrange(vocab) for _ in range(max(1, min(input_len, 16)))]
    engine.add_request(ids, sampling_params(4))
    while engine.has_unfinished_requests():
        engine.step()


def run_requests(
    engine: Any, requests: Sequence[BenchRequest], progress: ProgressFn | None = None
) -> dict:
    """Add every request at once and step until all finish; per-request timings from the loop.

    Returns elapsed seconds, token counts and per-request TTFT/E2E/TPOT lists (seconds,
    measured from the moment all requests were queued).
    """
    start = time.perf_counter()
    ids = [engine.add_request(list(r.prompt_token_ids), sampling_params(r.output_len))
           for r in requests]
    index = {rid: i for i, rid in enumerate(ids)}
    first: list[float | None] = [None] * len(ids)
    done: list[float | None] = [None] * len(ids)
    n_out = [0] * len(ids)
    n_prompt = [len(r.prompt_token_ids) for r in requests]
    steps = preemptions = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        advanced = 0
        for out in outs:
            i = index.get(out.request_id)
            if i is None:
                continue
            if out.new_token_ids and first[i] is None:
                first[i] = now
            advanced += len(out.new_token_ids)
            n_out[i] = len(out.token_ids)
            if out.finished:
                done[i] = now
                n_prompt[i] = len(out.prompt_token_ids)
                preemptions += out.metrics.num_preemptions
        if progress is not None and advanced:
            progress(advanced)
    elapsed = time.perf_counter() - start
    ttft = [f - start for f in first if f is not None]
    e2e = [d - start for d in done if d is not None]
    tpots = [
        t for f, d, n in zip(first, done, n_out)
        if f is not None and d is not None
        and (t := tpot(d - start, f - start, n)) is not None
    ]
    return {
        "elapsed_s": elapsed,
        "num_steps": steps,
        "num_preemptions": preemptions,
        "num_requests": len(ids),
        "num_finished": sum(d is not None for d in done),
        "prompt_tokens": sum(n_prompt),
        "output_tokens": sum(n_out),
        "ttft_list": ttft,
        "e2e_list": e2e,
        "tpot_list": tpots,
    }


def run_throughput(
    engine: Any,
    num_prompts: int = 64,
    input_len: int = 128,
    output_len: int = 64,
    seed: int = 0,
    *,
    requests: Sequence[BenchRequest] | None = None,
    warmup: bool = True,
    progress: ProgressFn | None = None,
) -> dict:
    """Offline throughput: all requests queued at once, continuous batching until done.

    ``requests`` (e.g. from a prompt file) replaces the synthetic prompts. Reports
    requests/s, output tokens/s and total (prompt + output) tokens/s over the wall time
    from queuing to the last token.
    """
    synthetic = requests is None
    if requests is None:
        requests = synthetic_requests(engine, num_prompts, input_len, output_len, seed)
    if warmup:
        _warmup(engine, input_len)
    r = run_requests(engine, requests, progress)
    elapsed = r["elapsed_s"]
    return {
        "benchmark": "throughput",
        "config": {
            "source": "synthetic" if synthetic else "dataset",
            "num_prompts": len(requests),
            "input_len": input_len if synthetic else None,
            "output_len": output_len if synthetic else None,
            "seed": seed,
        },
        "num_requests": r["num_requests"],
        "prompt_tokens": r["prompt_tokens"],
        "output_tokens": r["output_tokens"],
        "elapsed_s": elapsed,
        "num_steps": r["num_steps"],
        "num_preemptions": r["num_preemptions"],
        "requests_per_s": rate(r["num_finished"], elapsed),
        "output_tokens_per_s": rate(r["output_tokens"], elapsed),
        "total_tokens_per_s": rate(r["prompt_tokens"] + r["output_tokens"], elapsed),
        "ttft_s": summarize(r["ttft_list"]),
        "tpot_s": summarize(r["tpot_list"]),
    }


def latency_batches(
    engine: Any, batch_size: int, input_len: int, output_len: int, num_iters: int,
    warmup: int, seed: int = 0,
) -> tuple[list[list[BenchRequest]], list[list[BenchRequest]]]:
    """The (warm-up, timed) batches ``run_latency`` runs: seeds ``seed + 10_000 + i`` and
    ``seed + i``. A baseline given the same batches runs the very same prompts."""
    warm = [synthetic_requests(engine, batch_size, input_len, output_len, seed + 10_000 + i)
            for i in range(warmup)]
    timed = [synthetic_requests(engine, batch_size, input_len, output_len, seed + i)
             for i in range(num_iters)]
    return warm, timed


def run_latency(
    engine: Any,
    batch_size: int = 1,
    input_len: int = 32,
    output_len: int = 128,
    num_iters: int = 3,
    warmup: int = 1,
    *,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> dict:
    """Latency of one batch of ``batch_size`` requests, repeated ``num_iters`` times.

    Per iteration: E2E (queue to last token of the batch), and per request TTFT, E2E and
    TPOT = (E2E - TTFT) / (n - 1). ``warmup`` untimed iterations run first. Summaries
    (mean/median/p90/p99) are over iterations for ``latency_s`` and over all requests of all
    iterations for ``ttft_s``/``tpot_s``/``e2e_s``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if num_iters < 1:
        raise ValueError(f"num_iters={num_iters} must be >= 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    check_lengths(engine, input_len, output_len)
    warm_batches, batches = latency_batches(engine, batch_size, input_len, output_len,
                                            num_iters, warmup, seed)
    for reqs in warm_batches:
        run_requests(engine, reqs)
    iters, ttft, tpots, e2e = [], [], [], []
    for reqs in batches:
        r = run_requests(engine, reqs)
        iters.append({
            "latency_s": r["elapsed_s"],
            "ttft_s": max(r["ttft_list"], default=float("nan")),
            "tpot_s": (sum(r["tpot_list"]) / len(r["tpot_list"])) if r["tpot_list"]
            else None,
            "output_tokens": r["output_tokens"],
        })
        ttft += r["ttft_list"]
        tpots += r["tpot_list"]
        e2e += r["e2e_list"]
        if progress is not None:
            progress(1)
    latency = summarize([it["latency_s"] for it in iters])
    out_tokens = sum(it["output_tokens"] for it in iters)
    return {
        "benchmark": "latency",
        "config": {
            "batch_size": batch_size,
            "input_len": input_len,
            "output_len": output_len,
            "num_iters": num_iters,
            "warmup": warmup,
            "seed": seed,
        },
        "latency_s": latency,
        "ttft_s": summarize(ttft),
        "tpot_s": summarize(tpots),
        "e2e_s": summarize(e2e),
        "output_tokens_per_s": rate(out_tokens, sum(it["latency_s"] for it in iters)),
        "iterations": iters,
    }
