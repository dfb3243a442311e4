"""Plain vs speculative decoding on the same engine, same run, on bundled prompts.

Each prompt runs alone (batch 1), greedy, once with plain decoding (lookahead (1,1,0)) and
once with the engine's speculative setting (or a given window). Greedy speculative output
equals plain output, so both runs produce the same tokens and the ratio of tokens/s is the
speed-up. Tokens per step (acceptance) explains it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kiln.bench.prompts import CHAT_PROMPTS, CODE_PROMPTS
from kiln.runtime.sampling_params import SamplingParams

PROMPT_SETS = {"code": CODE_PROMPTS, "chat": CHAT_PROMPTS}


def _timed(engine: Any, prompt_ids: list[int], params: SamplingParams) -> dict:
    start = time.perf_counter()
    out = engine.generate([prompt_ids], params)[0]
    elapsed = time.perf_counter() - start
    m = out.metrics
    return {
        "elapsed_s": elapsed,
        "tokens": len(out.token_ids),
        "token_ids": out.token_ids,
        "spec_steps": m.spec_steps,
        "spec_tokens": m.spec_tokens,
        "decode_steps": m.num_steps,
    }


def _median_run(runs: list[dict]) -> dict:
    """The run with the median elapsed time (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["elapsed_s"])[(len(runs) - 1) // 2]


def run_speculative_latency(
    engine: Any,
    output_len: int = 128,
    prompts_per_set: int = 3,
    window: tuple[int, int, int] | None = None,
    warmup: int = 1,
    progress: Callable[[int], None] | None = None,
    repeats: int = 1,
) -> dict:
    """Per prompt set (code, chat): plain and speculative tokens/s, ratio, tokens/step.

    ``repeats``: each prompt runs plain then speculative that many times, alternating; the
    rates use each run's median time, and ``speedups`` lists the set's ratio per repeat
    (their spread is the noise of the number).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if engine.speculative.mode == "none":
        raise ValueError(
            "this engine has no speculative decoding (mode none); rebuild it with "
            "--speculative-decoding-mode lookahead --lookahead-config W,N,G (or ngram)"
        )
    plain_p = SamplingParams(max_tokens=output_len, temperature=0, lookahead=(1, 1, 0))
    spec_p = SamplingParams(max_tokens=output_len, temperature=0, lookahead=window)
    chat = getattr(engine.tokenizer, "chat_template", None)

    def encode(text: str) -> list[int]:
        if chat:
            return engine.apply_chat_template([{"role": "user", "content": text}])
        return engine.tokenizer.encode(text)

    for _ in range(warmup):
        first = encode(CODE_PROMPTS[0])
        engine.generate([first], SamplingParams(max_tokens=8, temperature=0))
        engine.generate([first], SamplingParams(max_tokens=8, temperature=0, lookahead=(1, 1, 0)))
    sets = {}
    for name, texts in PROMPT_SETS.items():
        rows = []
        for text in texts[:prompts_per_set]:
            ids = encode(text)
            runs = [(_timed(engine, ids, plain_p), _timed(engine, ids, spec_p))
                    for _ in range(repeats)]
            plain, spec = (_median_run([r[i] for r in runs]) for i in (0, 1))
            rows.append({"prompt": text, "plain": plain, "spec": spec,
                         "same_output": plain["token_ids"] == spec["token_ids"],
                         "elapsed_s_per_repeat": [[p["elapsed_s"], s["elapsed_s"]]
                                                  for p, s in runs]})
            if progress is not None:
                progress(1)
        p_tok = sum(r["plain"]["tokens"] for r in rows)
        s_tok = sum(r["spec"]["tokens"] for r in rows)
        p_time = sum(r["plain"]["elapsed_s"] for r in rows)
        s_time = sum(r["spec"]["elapsed_s"] for r in rows)
        s_steps = sum(r["spec"]["spec_steps"] for r in rows)
        s_committed = sum(r["spec"]["spec_tokens"] for r in rows)
        speedups = []
        for i in range(repeats):
            pt = sum(r["elapsed_s_per_repeat"][i][0] for r in rows)
            st = sum(r["elapsed_s_per_repeat"][i][1] for r in rows)
            speedups.append((s_tok / st) / (p_tok / pt) if pt and st else None)
        for r in rows:
            del r["plain"]["token_ids"], r["spec"]["token_ids"]
        sets[name] = {
            "plain_tokens_per_s": p_tok / p_time if p_time else None,
            "spec_tokens_per_s": s_tok / s_time if s_time else None,
            "speedup": (s_tok / s_time) / (p_tok / p_time) if p_time and s_time else None,
            "speedups": speedups,
            "tokens_per_step": s_committed / s_steps if s_steps else None,
            "same_output": all(r["same_output"] for r in rows),
            "requests": rows,
        }
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
            "batch_size": 1,
            "greedy": True,
        },
        "sets": sets,
    }
