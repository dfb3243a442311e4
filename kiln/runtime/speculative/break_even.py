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


class LLMEngine(Protocol):
    """What the measurement uses of ``kiln.runtime.engine.LLMEngine`` (which calls it
    from its constructor, once it can run steps)."""

    config: Any
    runner: Any
    device: torch.device
    speculative: Any
    model_config: Any
    limits: Any
    spec_break_even: float | None
    spec_stats: dict[str, int]
    num_steps: int

    def add_request(self, prompt: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str: ...

    def step(self) -> list: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...


def spec_break_even(engine: LLMEngine) -> float | None:
    """RuntimeConfig.spec_break_even, else measured on CUDA: the wall time of a
    one-sequence speculative engine step over a plain one (lookahead engines: host work
    included, median of 3 short runs of ``measure_step_ms``), or, where that cannot be
    measured, the speculative step's graph replay over a decode step's (GPU time only).
    None: no pacing (adaptive speculation off, or nothing to measure: no CUDA graphs).

    The wall ratio paces better than the replay ratio because it counts a speculative
    step's host work: smollm2 lookahead (7,7,7) code prompts x1.05 of plain decoding
    against x0.84 (docs/decisions.md)."""
    cfg = engine.config
    if not cfg.adaptive_speculation:
        return None
    if cfg.spec_break_even is not None:
        if cfg.spec_break_even <= 0:
            raise ValueError(f"spec_break_even={cfg.spec_break_even} must be > 0 "
                             "(committed tokens per speculative step)")
        return float(cfg.spec_break_even)
    graphs = engine.runner.graphs
    if graphs is None or engine.device.type != "cuda":
        return None
    walls = [measure_step_ms(engine, steps=16, warmup=8) for _ in range(3)]
    if all(walls):
        return (statistics.median(w["spec"] for w in walls)
                / statistics.median(w["plain"] for w in walls))
    return replay_break_even(engine)

def replay_break_even(engine: LLMEngine) -> float | None:
    """A one-sequence speculative step's graph replay over a decode step's (GPU time
    only); None without both graphs."""
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    spec = graphs.find_bucket(1, engine.speculative.tokens_per_step,
                              engine.speculative.mode == "lookahead")
    plain = graphs.find_bucket(1, 1, False)
    if spec not in graphs.graphs or plain not in graphs.graphs:  # None or not captured
        return None
    return graphs.replay_ms(spec) / graphs.replay_ms(plain)

def measure_step_ms(engine: LLMEngine, steps: int = 16, warmup: int = 4
                    ) -> dict[str, float] | None:
    """Wall milliseconds per engine step of one sequence on a dummy request, decoding
    plainly and speculating with the engine's window (host work included, which the
    graph replays of ``replay_break_even`` leave out). ``spec / plain`` is the break-even
    that counts a speculative step's host time.
    None for engines that are not lookahead engines or that have requests in flight."""
    if engine.speculative.mode != "lookahead" or engine.has_unfinished_requests():
        return None
    vocab = engine.model_config.vocab_size
    prompt = [(7 * i + 11) % vocab for i in range(8)]
    room = engine.limits.max_seq_len - len(prompt)
    if room < 2:
        return None  # no room for a step after the prompt's
    saved = (engine.spec_break_even, dict(engine.spec_stats), engine.num_steps)
    engine.spec_break_even = None  # the dummy requests are not paced
    out: dict[str, float] = {}
    try:
        for name, window in (("plain", (1, 1, 0)), ("spec", engine.speculative.lookahead)):
            rid = engine.add_request(prompt, SamplingParams(
                max_tokens=room, temperature=0, ignore_eos=True, lookahead=window),
                request_id=f"kiln-measure-{name}")
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
                engine.abort(rid)
                while engine.has_unfinished_requests():
                    engine.step()
    finally:
        engine.spec_break_even, engine.spec_stats, engine.num_steps = saved
    return out if len(out) == 2 else None


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
