"""The break-even of adaptive speculation: how many committed tokens a speculative step must
average to pay for itself, measured once at engine start-up (``spec_break_even``).

A request whose mean stays below it decodes plainly for a while (``pace.SpecPace``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Protocol

import torch

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative.pace import BreakEven


class LLMEngine(Protocol):
    """What the measurement uses of ``kiln.runtime.engine.LLMEngine`` (which calls it
    from its constructor, once it can run steps)."""

    config: Any
    runner: Any
    device: torch.device
    speculative: Any
    model_config: Any
    limits: Any
    proposer: Any  # its ``break_even``: pacing, off while measuring
    scheduler: Any
    blocks: Any
    spec_worker: Any
    spec_stats: dict[str, int]
    num_steps: int

    def add_request(self, prompt: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str: ...

    def step(self) -> list: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...


MEASURED_BATCH = 8  # the larger batch the break-even is measured at (or max_num_seqs)
DUMMY_PROMPT_LEN = 8  # tokens of each dummy request's prompt


def spec_break_even(engine: LLMEngine) -> BreakEven | None:
    """RuntimeConfig.spec_break_even (the same at every batch size), else measured on CUDA:
    the wall time of a speculative engine step over a plain one at batch 1 and at
    ``MEASURED_BATCH`` (host work included, every step at full T, median of 3 short runs of
    ``measure_step_ms``), or, where that cannot be measured, the
    speculative step's graph replay over a decode step's at batch 1 (GPU time only).
    None: no pacing (adaptive speculation off, or nothing to measure: no CUDA graphs).

    The wall ratio paces better than the replay ratio because it counts a speculative
    step's host work: smollm2 lookahead (7,7,7) code prompts x1.05 of plain decoding
    against x0.84 (docs/decisions.md). Full T because the step's cost grows with the pool's
    candidates: a dummy request's pool holds few, and measuring its steps made the
    break-even too low for real prompts."""
    cfg = engine.config
    if not cfg.adaptive_speculation:
        return None
    if cfg.spec_break_even is not None:
        if cfg.spec_break_even <= 0:
            raise ValueError(f"spec_break_even={cfg.spec_break_even} must be > 0 "
                             "(committed tokens per speculative step)")
        return BreakEven(((1, float(cfg.spec_break_even)),))
    graphs = engine.runner.graphs
    if graphs is None or engine.device.type != "cuda":
        return None
    points = []
    for batch in sorted({1, max(1, min(MEASURED_BATCH, engine.scheduler.max_num_seqs))}):
        walls = [measure_step_ms(engine, steps=16, warmup=8, batch=batch) for _ in range(3)]
        if all(walls):
            points.append((batch, statistics.median(w["spec"] for w in walls)
                           / statistics.median(w["plain"] for w in walls)))
    if points:
        return BreakEven(tuple(points))
    ratio = replay_break_even(engine)
    return None if ratio is None else BreakEven(((1, ratio),))


def replay_break_even(engine: LLMEngine) -> float | None:
    """A one-sequence speculative step's graph replay over a decode step's (GPU time
    only); None without both graphs."""
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    # lookahead's candidates and suffix decoding's trees run masked steps
    spec = graphs.find_bucket(1, engine.speculative.tokens_per_step,
                              engine.speculative.mode in ("lookahead", "suffix"))
    plain = graphs.find_bucket(1, 1, False)
    if spec not in graphs.graphs or plain not in graphs.graphs:  # None or not captured
        return None
    return graphs.replay_ms(spec) / graphs.replay_ms(plain)


def measure_step_ms(engine: LLMEngine, steps: int = 16, warmup: int = 4, batch: int = 1
                    ) -> dict[str, float] | None:
    """Wall milliseconds per engine step of ``batch`` dummy requests, decoding plainly and
    speculating with the engine's setting at full T (lookahead: every step with G
    candidates; ngram: every draft max_draft_len long; suffix: max_draft_len nodes in a
    branching tree, the masked path; host work included, which the graph
    replays of ``replay_break_even`` leave out).
    ``spec / plain`` is the break-even that counts a speculative step's host time.
    None for engines that do not speculate, that have requests in flight or that cannot
    hold ``batch`` dummy requests."""
    spec = engine.speculative
    if (not spec.enabled or engine.has_unfinished_requests()
            or batch > engine.scheduler.max_num_seqs):
        return None
    vocab = engine.model_config.vocab_size
    prompts = [[(7 * i + 11 + 13 * b) % vocab for i in range(DUMMY_PROMPT_LEN)]
               for b in range(batch)]
    # the most a step commits: N for lookahead, every draft and the bonus for ngram and
    # draft models
    most = spec.lookahead[1] if spec.mode == "lookahead" else spec.tokens_per_step
    room = min(engine.limits.max_seq_len - DUMMY_PROMPT_LEN, (steps + warmup + 1) * most)
    kv_tokens = engine.blocks.num_blocks * engine.blocks.block_size
    if room < 2 or batch * (DUMMY_PROMPT_LEN + room) > kv_tokens:
        return None  # no room for a step after the prompt's, or not enough KV for all
    saved = (engine.proposer.break_even, dict(engine.spec_stats), engine.num_steps)
    engine.proposer.break_even = None  # the dummy requests are not paced
    worker = engine.spec_worker
    out: dict[str, float] = {}
    try:
        worker.full_steps = True
        # None: the engine's own setting (an ngram engine's requests name no window)
        for name, window in (("plain", (1, 1, 0)), ("spec", spec.lookahead)):
            rids = [engine.add_request(p, SamplingParams(
                max_tokens=room, temperature=0, ignore_eos=True, lookahead=window),
                request_id=f"kiln-measure-{name}-{b}") for b, p in enumerate(prompts)]
            try:
                for _ in range(warmup):
                    engine.step()
                _sync(engine)
                t0, n = time.perf_counter(), 0
                while n < steps and engine.has_unfinished_requests():
                    engine.step()
                    n += 1
                _sync(engine)
                if n:
                    out[name] = (time.perf_counter() - t0) * 1e3 / n
            finally:
                for rid in rids:
                    engine.abort(rid)
                while engine.has_unfinished_requests():
                    engine.step()
    finally:
        worker.full_steps = False
        engine.proposer.break_even, engine.spec_stats, engine.num_steps = saved
    return out if len(out) == 2 else None


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
