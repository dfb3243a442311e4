"""Once an engine is ready, serving compiles no Triton kernel variant: every variant a request
can need was compiled (or loaded) at start-up, by graph capture or the warm-up
(kiln/runtime/warmup.py). A variant compiled mid-serving stalls the engine thread 0.5-1.9 s
while every request waits (docs/decisions.md)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="compiled kernels, not the interpreter"),
]


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 + salt) % 5000 + 100 for i in range(n)]


@pytest.mark.parametrize("spec", [None, "lookahead", "lookahead-device", "ngram", "draft"])
def test_serving_mix_compiles_nothing_after_start(tmp_path, spec):
    from triton import knobs

    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    out = tmp_path / "e"
    build_engine("random:smollm2-135m", out, dtype="bfloat16", max_seq_len=2048,
                 max_num_tokens=2048, max_batch_size=16, progress=False,
                 speculative=(SpeculativeConfig.from_cli("ngram", None, 6, 2) if spec == "ngram"
                              else SpeculativeConfig.from_cli(
                                  "draft", max_draft_len=4, draft_model="random:smollm2-135m")
                              if spec == "draft"
                              else SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None)
                              if spec else None))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cuda", device_speculation=True if spec == "lookahead-device" else None))
    assert eng.startup_times["warmup_s"] > 0
    compiled: list[str] = []
    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *, fn, **_: compiled.append(fn.name)
    try:
        greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        for n in (1, 2, 5, 16, 17, 33, 64, 100, 255, 500, 777, 1000, 1900):
            for t in (0.0, 0.8):
                eng.generate([_prompt(n)], SamplingParams(max_tokens=3, temperature=t,
                                                          ignore_eos=True))
        mixed = [SamplingParams(max_tokens=8, temperature=t, ignore_eos=True)
                 for t in (0.0, 0.8, 1.0, 0.5)]
        eng.generate([_prompt(20, i) for i in range(4)], mixed)
        for p in (SamplingParams(max_tokens=6, top_p=0.9), SamplingParams(max_tokens=6, top_k=5),
                  SamplingParams(max_tokens=6, min_p=0.1), SamplingParams(max_tokens=6, seed=3),
                  SamplingParams(max_tokens=6, logprobs=2),
                  SamplingParams(max_tokens=6, repetition_penalty=1.2)):
            eng.generate([_prompt(20)], p)
        eng.generate([_prompt(n, n) for n in (5, 9, 40, 77, 130, 260, 511, 700)], greedy)
        eng.generate([_prompt(30, i) for i in range(16)],
                     SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True))
        if spec:  # speculative steps at several batch sizes (masked graphs and eager),
            # greedy and sampled (verified on the device where the state is there)
            code = _prompt(12) * 6
            window = None if spec in ("ngram", "draft") else (4, 3, 4)
            for t in (0.0, 0.8):
                for n in (1, 3, 12):
                    eng.generate([code] * n, SamplingParams(
                        max_tokens=24, temperature=t, ignore_eos=True, lookahead=window))
        state = eng.runner.spec_step.proposer if eng.runner.spec_step is not None else None
        if state is not None and hasattr(state, "window"):  # lookahead's fold of pending
            # tokens, at the widths paced requests bring (1, a multiple of 16, the rest)
            for width in (1, 5, 16, 40):
                slots = torch.tensor([0, -1], device="cuda")
                toks = torch.zeros(2, width, dtype=torch.long, device="cuda")
                state.fold(slots, toks, torch.tensor([width, 0], device="cuda"))
            torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = old
    assert compiled == [], f"kernel variants compiled after start-up: {compiled}"
    eng.blocks.check_all_free()
