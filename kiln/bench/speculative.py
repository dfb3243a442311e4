"""Plain vs speculative decoding on the same engine, same run, on bundled prompts.

Per prompt set (input-grounded tasks, code, chat, agentic turns) and batch size, greedy: each batch runs
once with plain decoding (lookahead (1,1,0)) and once with the engine's speculative setting
(or a given window), alternating. Greedy speculative output equals plain output, so both runs
produce the same tokens and the ratio of tokens/s is the speed-up. Two numbers explain it:
tokens per speculative step (acceptance) and the cost of an engine step of the speculative
run over one of the plain run (wall time, host work included). ``replay_cost`` adds the GPU
time alone: a speculative step's CUDA graph replay over a decode step's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from kiln.artifact.speculative import PLAIN, tokens_per_step
from kiln.bench.prompts import AGENTIC_PROMPTS, CHAT_PROMPTS, CODE_PROMPTS, GROUNDED_PROMPTS
from kiln.runtime.sampling_params import SamplingParams

PROMPT_SETS = {"grounded": GROUNDED_PROMPTS, "code": CODE_PROMPTS, "chat": CHAT_PROMPTS,
               "agentic": AGENTIC_PROMPTS}
BATCH_SIZES = (1, 8)


def check_batch_sizes(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """The batch sizes, in order, once each; raises ValueError unless all are ints >= 1."""
    bad = [b for b in batch_sizes if not isinstance(b, int) or b < 1]
    if not batch_sizes or bad:
        raise ValueError(f"batch sizes {list(batch_sizes)} must be one or more integers >= 1 "
                         "(e.g. 1,8)")
    return tuple(dict.fromkeys(batch_sizes))


def batch_groups(texts: Sequence[str], batch_size: int, prompts_per_set: int
                 ) -> list[list[str]]:
    """The batches one set runs at ``batch_size``: at 1, each of its first
    ``prompts_per_set`` prompts alone; above 1, one batch of its first ``batch_size``
    prompts (cycled when the set has fewer)."""
    if batch_size == 1:
        return [[t] for t in texts[:prompts_per_set]]
    return [list(itertools.islice(itertools.cycle(texts), batch_size))]


def num_runs(engine: Any, prompts_per_set: int,
             batch_sizes: Sequence[int] = BATCH_SIZES) -> int:
    """How many batches ``run_speculative_latency`` times (its progress total)."""
    sizes, _ = _split_batch_sizes(engine, check_batch_sizes(batch_sizes))
    return sum(len(batch_groups(texts, b, prompts_per_set))
               for texts in PROMPT_SETS.values() for b in sizes)


def _split_batch_sizes(engine: Any, sizes: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(sizes the engine runs in one step, sizes above its max_num_seqs): a batch of more
    sequences than one step takes would queue, and its numbers would be of a smaller one."""
    cap = engine.scheduler.max_num_seqs
    return [b for b in sizes if b <= cap], [b for b in sizes if b > cap]


def _timed(engine: Any, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One generate of ``prompts`` together: wall time, engine steps (``num_steps`` counts
    one per committed step, prefill included) and the requests' summed statistics."""
    steps, masked = engine.num_steps, engine.spec_stats["engine_steps"]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "engine_steps": engine.num_steps - steps,
        "masked_engine_steps": engine.spec_stats["engine_steps"] - masked,
        "tokens": sum(len(o.token_ids) for o in outs),
        "token_ids": [o.token_ids for o in outs],
        "spec_steps": sum(o.metrics.spec_steps for o in outs),
        "spec_tokens": sum(o.metrics.spec_tokens for o in outs),
        "spec_cached_tokens": sum(o.metrics.spec_cached_tokens for o in outs),
        "decode_steps": sum(o.metrics.num_steps for o in outs),
    }


def _median_run(runs: list[dict]) -> dict:
    """The run with the median elapsed time (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["elapsed_s"])[(len(runs) - 1) // 2]


def _run_batch(engine: Any, texts: list[str], ids: list[list[int]], plain_p: SamplingParams,
               spec_p: SamplingParams, repeats: int) -> dict:
    """One batch plain then speculative, ``repeats`` times alternating; the median runs.

    An untimed one-token run first puts the prompts in the prefix cache, so that the first
    timed run (plain) does not alone pay their whole prefill."""
    engine.generate(ids, SamplingParams(max_tokens=1, temperature=0, lookahead=PLAIN))
    runs = [(_timed(engine, ids, plain_p), _timed(engine, ids, spec_p)) for _ in range(repeats)]
    plain, spec = (_median_run([r[i] for r in runs]) for i in (0, 1))
    # sampled runs draw different texts (both distributed as plain sampling): nothing to compare
    same = plain["token_ids"] == spec["token_ids"] if plain_p.greedy else None
    for p, s in runs:
        del p["token_ids"], s["token_ids"]
    return {"prompts": texts, "plain": plain, "spec": spec, "same_output": same,
            "elapsed_s_per_repeat": [[p["elapsed_s"], s["elapsed_s"]] for p, s in runs]}


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den; None where either is missing or den is 0."""
    return num / den if num is not None and den else None


def _share(part: float, whole: float) -> float | None:
    """part / whole, at most 1; None where whole is 0."""
    r = _ratio(part, whole)
    return None if r is None else min(1.0, r)


def _summary(rows: list[dict], batch_size: int, repeats: int) -> dict:
    """A set's numbers at one batch size from its batches' median runs.

    ``tokens_per_step``: tokens committed per speculative step of a request (summed over
    requests). ``*_ms_per_step``: wall time per engine step of the plain / speculative runs
    (both count the step that prefills the cached prompts' last tokens and makes the first
    token); ``step_cost_ratio`` is spec over plain. ``spec_step_fraction``: speculative steps per
    request (their sum / ``batch_size``) over the speculative run's engine steps, at most 1;
    below 1 where steps ran plainly (the prefill step, paused or draftless requests) or
    requests finished early, and the spec step cost then mixes in plain steps.
    ``masked_step_fraction``: the speculative run's engine steps that verified any draft
    (a masked step for the whole batch, synchronous on the host path) over all its engine
    steps; above ``spec_step_fraction`` at batch > 1 when only some requests draft.
    """
    def total(kind: str, key: str) -> float:
        return sum(r[kind][key] for r in rows)

    p_tok, s_tok = total("plain", "tokens"), total("spec", "tokens")
    p_time, s_time = total("plain", "elapsed_s"), total("spec", "elapsed_s")
    p_steps, s_steps = total("plain", "engine_steps"), total("spec", "engine_steps")
    p_ms, s_ms = _ratio(1e3 * p_time, p_steps), _ratio(1e3 * s_time, s_steps)
    speedups = []
    for i in range(repeats):
        pt = sum(r["elapsed_s_per_repeat"][i][0] for r in rows)
        st = sum(r["elapsed_s_per_repeat"][i][1] for r in rows)
        speedups.append(_ratio(_ratio(s_tok, st), _ratio(p_tok, pt)))
    fraction = _ratio(total("spec", "spec_steps") / batch_size, s_steps)
    return {
        "batch_size": batch_size,
        "plain_tokens_per_s": _ratio(p_tok, p_time),
        "spec_tokens_per_s": _ratio(s_tok, s_time),
        "speedup": _ratio(_ratio(s_tok, s_time), _ratio(p_tok, p_time)),
        "speedups": speedups,
        "tokens_per_step": _ratio(total("spec", "spec_tokens"), total("spec", "spec_steps")),
        # of the accepted draft tokens (each speculative step commits them + one of its own,
        # but a request's last step may stop short)
        "cache_share": _share(sum(r["spec"].get("spec_cached_tokens", 0) for r in rows),
                              total("spec", "spec_tokens") - total("spec", "spec_steps")),
        "same_output": (None if any(r["same_output"] is None for r in rows)
                        else all(r["same_output"] for r in rows)),
        "plain_engine_steps": p_steps,
        "spec_engine_steps": s_steps,
        "plain_ms_per_step": p_ms,
        "spec_ms_per_step": s_ms,
        "step_cost_ratio": _ratio(s_ms, p_ms),
        "spec_step_fraction": None if fraction is None else min(1.0, fraction),
        "masked_step_fraction": _ratio(total("spec", "masked_engine_steps"), s_steps),
        "requests": rows,
    }


def replay_cost(engine: Any, batch_sizes: Sequence[int] = BATCH_SIZES,
                window: tuple[int, int, int] | None = None) -> dict | None:
    """GPU time alone: per batch size b, the graph replay of the speculative step of b
    sequences over that of a decode step of b (``replay_ms``: median of CUDA-event timed
    replays on all-padding inputs), with the buckets the engine's runner would pick.

    A speculative step feeds ``tokens_per_step`` tokens per sequence (the engine's, or the
    request ``window``'s); lookahead steps run masked (tree) buckets. A draft-model step
    also runs its draft: ``spec_ms`` adds max_draft_len of the draft's decode replays at b
    sequences (``draft_ms``, each; the catch-up step, 1-2 tokens a sequence, counted as
    one of them: a lower bound). Returns ``{"b": {"decode_ms", "spec_ms", "ratio",
    "decode_bucket", "spec_bucket"}}`` (buckets as [num_seqs, num_tokens]; draft engines:
    and "draft_ms") for the sizes with every bucket captured; None off CUDA or without
    CUDA graphs. Run it with no requests in flight (it restages the inputs).
    """
    graphs = engine.runner.graphs
    if graphs is None or engine.device.type != "cuda":
        return None
    spec = engine.speculative
    lookahead = spec.mode == "lookahead"
    per_seq = tokens_per_step(*window) if window and lookahead else spec.tokens_per_step
    draft = (engine.spec_worker.draft_model.runner.graphs if spec.mode == "draft" else None)
    if spec.mode == "draft" and draft is None:
        return None
    out = {}
    for b in batch_sizes:
        decode = graphs.find_bucket(b, b, False)
        masked = graphs.find_bucket(b, b * per_seq, lookahead)
        draft_decode = draft.find_bucket(b, b, False) if draft is not None else None
        if decode is None or masked is None or (draft is not None and draft_decode is None):
            continue
        decode_ms, spec_ms = graphs.replay_ms(decode), graphs.replay_ms(masked)
        row = {"decode_ms": decode_ms, "spec_ms": spec_ms}
        if draft_decode is not None:
            row["draft_ms"] = draft.replay_ms(draft_decode)
            row["spec_ms"] = spec_ms = spec_ms + spec.max_draft_len * row["draft_ms"]
        out[str(b)] = {**row, "ratio": spec_ms / decode_ms,
                       "decode_bucket": [decode.num_seqs, decode.num_tokens],
                       "spec_bucket": [masked.num_seqs, masked.num_tokens]}
    return out


def run_speculative_latency(
    engine: Any,
    output_len: int = 128,
    prompts_per_set: int = 3,
    window: tuple[int, int, int] | None = None,
    warmup: int = 1,
    progress: Callable[[int], None] | None = None,
    repeats: int = 1,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict:
    """Per prompt set (grounded, code, chat, agentic) and batch size: plain and speculative tokens/s,
    speed-up, tokens/step and the cost of an engine step (see ``_summary``).

    ``batch_sizes``: at 1 each of a set's first ``prompts_per_set`` prompts runs alone; at
    b > 1 its first b prompts run together (``batch_groups``). Sizes above the engine's
    max_num_seqs are skipped (``config["skipped_batch_sizes"]``). ``repeats``: each batch
    runs plain then speculative that many times, alternating; the rates use each one's
    median time, and ``speedups`` lists the ratio per repeat (their spread is the noise).
    ``temperature`` > 0: both runs sample at it (speculative steps verify by the rejection
    rule); their texts differ, so ``same_output`` is None and the rates compare tokens/s.
    ``top_p`` < 1: both runs sample from the nucleus too (with ``temperature`` > 0).

    Result: ``sets[name]["batches"][str(b)]`` holds a set's numbers at batch b;
    ``sets[name]`` itself also carries the batch-1 numbers at its top level (when batch 1
    ran), as before batch sizes existed. ``replay`` is ``replay_cost`` (None off CUDA).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    sizes, skipped = _split_batch_sizes(engine, check_batch_sizes(batch_sizes))
    if engine.speculative.mode == "none":
        raise ValueError(
            "this engine has no speculative decoding (mode none); rebuild it with "
            "--speculative-decoding-mode lookahead --lookahead-config W,N,G (or ngram)"
        )
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature!r} must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1: the whole distribution)")
    plain_p = SamplingParams(max_tokens=output_len, temperature=temperature, top_p=top_p,
                             lookahead=PLAIN)
    spec_p = SamplingParams(max_tokens=output_len, temperature=temperature, top_p=top_p,
                            lookahead=window)
    chat = getattr(engine.tokenizer, "chat_template", None)

    def encode(text: str) -> list[int]:
        if chat:
            return engine.apply_chat_template([{"role": "user", "content": text}])
        return engine.tokenizer.encode(text)

    first = encode(CODE_PROMPTS[0])
    for _ in range(warmup):
        for b in sizes:
            for look in (None, PLAIN):
                engine.generate([first] * b,
                                SamplingParams(max_tokens=8, temperature=0, lookahead=look))
    sets = {}
    for name, texts in PROMPT_SETS.items():
        batches = {}
        for b in sizes:
            rows = []
            for group in batch_groups(texts, b, prompts_per_set):
                rows.append(_run_batch(engine, group, [encode(t) for t in group], plain_p,
                                       spec_p, repeats))
                if progress is not None:
                    progress(1)
            batches[str(b)] = _summary(rows, b, repeats)
        sets[name] = {**batches.get("1", {}), "batches": batches}
    spec = engine.speculative
    return {
        "benchmark": "speculative_latency",
        "config": {
            "mode": spec.mode,
            "engine_window": list(spec.lookahead) if spec.lookahead else None,
            "request_window": list(window) if window else None,
            "max_draft_len": spec.max_draft_len,
            "output_len": output_len,
            "prompts_per_set": prompts_per_set,
            "repeats": repeats,
            "dtype": str(getattr(engine, "dtype", "")).removeprefix("torch.") or None,
            "batch_sizes": sizes,
            "skipped_batch_sizes": skipped,
            "max_num_seqs": engine.scheduler.max_num_seqs,
            "greedy": plain_p.greedy,
            "temperature": temperature,
            "top_p": top_p,
        },
        "sets": sets,
        "replay": replay_cost(engine, sizes, window),
    }
