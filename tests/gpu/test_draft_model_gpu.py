"""On CUDA: draft-model speculative decoding (the draft's staged steps and CUDA graphs, the
drafts scattered into the target's verify step on the device) commits exactly plain greedy
decoding's tokens (float32), with the target drafting for itself (every draft accepted) and
with another model drafting (most rejected), graphs on and off, beside plain requests; a
seeded sampled request gives the same tokens alone and in a batch."""

from __future__ import annotations

import os
import types

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="compiled kernels, not the interpreter"),
]

PROMPTS = [[100 + (7 * i + j) % 50 for i in range(12 + 3 * j)] * 2 for j in range(4)]


def _engine(draft_seed: int | None, graphs: bool, k: int = 4, device: bool | None = None):
    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.artifact.weights import random_weights
    from kiln.runtime.engine import EngineLimits, LLMEngine, RuntimeConfig
    from kiln.sources import make_byte_tokenizer
    from kiln.sources.random import PRESETS

    cfg = PRESETS["smollm2-135m"]
    spec = types.SimpleNamespace(
        generation_defaults=types.SimpleNamespace(values={}),
        speculative=SpeculativeConfig(mode="draft", max_draft_len=k, draft_model="in-process"))
    w = random_weights(cfg, 0, device="cuda", dtype=torch.float32)
    dw = w if draft_seed is None else random_weights(cfg, draft_seed, device="cuda",
                                                     dtype=torch.float32)
    return LLMEngine(cfg, w, make_byte_tokenizer(), EngineLimits(8, 512, 500, 1024),
                     torch.float32, RuntimeConfig(device="cuda", cuda_graphs=graphs,
                                                  gpu_memory_utilization=0.3,
                                                  device_speculation=device),
                     spec=spec, draft=(cfg, dw))


def _greedy(window=None):
    from kiln.runtime.sampling_params import SamplingParams

    return SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, lookahead=window)


@pytest.mark.parametrize("device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("draft_seed", [None, 1], ids=["self-draft", "other-draft"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_draft_model_greedy_equals_plain_on_cuda(draft_seed, graphs, device):
    """Verified on the device (the default on CUDA: steps launched ahead, the draft's
    positions moved on by the device) and on the host."""
    eng = _engine(draft_seed, graphs, device=device)
    plain = [o.token_ids for o in eng.generate(PROMPTS, _greedy((1, 1, 0)))]
    ahead = []
    draft = eng.spec_worker.draft_model
    real = draft.draft_ahead
    draft.draft_ahead = lambda reqs, state: ahead.append(len(reqs)) or real(reqs, state)
    outs = eng.generate(PROMPTS, _greedy())
    assert [o.token_ids for o in outs] == plain
    assert all(o.error is None for o in outs)
    if device:
        assert eng.spec_stats["sync_engine_steps"] == 0
        assert ahead, eng.spec_stats
    else:
        assert not ahead
    steps = sum(o.metrics.spec_steps for o in outs)
    tokens = sum(o.metrics.spec_tokens for o in outs)
    assert steps > 0
    if draft_seed is None:
        assert tokens > 3 * steps, (tokens, steps)
    if graphs:
        assert eng.spec_worker.draft_model.runner.graphs.num_replays > 0
    mixed = eng.generate(PROMPTS, [_greedy((1, 1, 0) if i % 2 else None)
                                   for i in range(len(PROMPTS))])
    assert [o.token_ids for o in mixed] == plain
    eng.blocks.check_all_free()


def test_seeded_sampled_draft_request_is_reproducible_on_cuda():
    from kiln.runtime.sampling_params import SamplingParams

    eng = _engine(None, True)
    p = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True)
    alone = eng.generate([PROMPTS[0]], p)[0]
    batch = eng.generate(PROMPTS, [p] + [SamplingParams(max_tokens=32, temperature=1.0,
                                                         ignore_eos=True)] * 3)
    assert batch[0].token_ids == alone.token_ids
    assert alone.metrics.spec_tokens > alone.metrics.spec_steps
