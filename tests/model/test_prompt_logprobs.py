"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers (float32, CPU).

Oracle: ``log_softmax(model(ids).logits.float())`` of the tiny random reference models, the
logprob of each prompt token at the position before it, and torch.topk of the same rows.
Tolerance: atol 1e-4 on every logprob (float32 on both sides; kiln's attention sums in a
different order). Checked alone, under chunked prefill (a prompt longer than the step's
token budget), in a batch mixing requests with and without prompt logprobs, with the prefix
cache holding the prompt's blocks, under forced recompute preemption (between prompt chunks
too), and on speculative engines.
"""

from __future__ import annotations

import pytest
import torch
from helpers import mixed_prompts

from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

ATOL = 1e-4
K = 5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_reference):
    return tiny_reference(request.param)


def _ref(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is the distribution of prompt token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check(model, prompt: list[int], got, k: int = K) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = _ref(model, prompt)
    vals, idx = ref.topk(k, dim=-1)
    for p, lp in enumerate(got[1:]):
        tok = prompt[p + 1]
        assert lp.token_id == tok
        assert abs(lp.logprob - ref[p, tok].item()) <= ATOL, (p, lp.logprob, ref[p, tok])
        assert lp.rank == 1 + int((ref[p] > ref[p, tok]).sum())
        assert list(lp.top) == idx[p].tolist(), p  # the top k, most likely first
        assert torch.allclose(torch.tensor(list(lp.top.values())), vals[p], atol=ATOL)


def _params(k: int | None = K, n: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, prompt_logprobs=k)


def test_prompt_logprobs_chunked_and_mixed_batch(tiny):
    model, engine_dir = tiny
    prompts = mixed_prompts()  # 3..40 tokens: 40 and 30 are chunked by the 16-token budget
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        device="cpu", block_size=4, max_num_tokens=16))
    params = [_params() if i % 2 == 0 else _params(None) for i in range(len(prompts))]
    params[4] = _params(0)  # 40 tokens, no alternatives
    outs = eng.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            _check(model, prompt, out.prompt_logprobs, p.prompt_logprobs)
    assert all(lp.top == {} for lp in outs[4].prompt_logprobs[1:])
    # the generated tokens do not change
    plain = eng.generate(prompts, _params(None))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    eng.blocks.check_all_free()


def test_prompt_logprobs_skip_prefix_cache_hits_and_publish_blocks(tiny):
    model, engine_dir = tiny
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu", block_size=4))
    base = mixed_prompts()[4]  # 40 tokens
    shared = base[:24] + mixed_prompts()[1]  # 6 full blocks shared with ``base``
    eng.generate([base], _params(None))  # its blocks are in the prefix cache now
    out = eng.generate([shared], _params())[0]
    assert out.metrics.num_cached_prompt_tokens == 0  # scored from position 0
    _check(model, shared, out.prompt_logprobs)
    # a scoring request publishes its blocks: the same prompt without scoring hits them all
    again = eng.generate([shared], _params(None))[0]
    assert again.metrics.num_cached_prompt_tokens == 40
    assert again.token_ids == out.token_ids
    eng.blocks.check_all_free()


def test_prompt_logprobs_under_preemption(tiny):
    model, engine_dir = tiny
    prompts = mixed_prompts()
    # a cache far too small for every request (forced recompute preemption) and a
    # 16-token budget: some requests are preempted between prompt chunks or while decoding
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        device="cpu", block_size=4, num_kv_blocks=32, max_num_tokens=16, reserve_kv=False))
    outs = eng.generate(prompts, _params(n=24))
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for prompt, out in zip(prompts, outs):
        _check(model, prompt, out.prompt_logprobs)
    eng.blocks.check_all_free()


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny):
    """A request preempted between prompt chunks keeps the scores it has; its recompute
    scores only the positions still missing (no duplicates, none lost)."""
    from kiln.runtime.scheduler import ScheduledBatch

    model, engine_dir = tiny
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        device="cpu", block_size=4, max_num_tokens=16))
    prompt = mixed_prompts()[4]  # 40 tokens: chunks of 16
    rid = eng.add_request(prompt, _params())
    assert eng.step() == []  # the first chunk: positions 0..15 score tokens 1..16
    req = eng._requests[rid]
    assert len(req.prompt_logprobs) == 17
    eng.scheduler._preempt(req, ScheduledBatch())  # recompute from position 0
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].metrics.num_preemptions == 1
    _check(model, prompt, outs[-1].prompt_logprobs)
    eng.blocks.check_all_free()


def test_prompt_logprobs_on_every_output_once_scored(tiny):
    model, engine_dir = tiny
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        device="cpu", block_size=4, max_num_tokens=16))
    prompt = mixed_prompts()[4]  # 40 tokens: three chunks without outputs, then tokens
    outs = list(eng.stream(prompt, _params(n=4)))
    assert all(o.new_token_ids for o in outs)
    assert all(o.prompt_logprobs is outs[0].prompt_logprobs for o in outs)
    _check(model, prompt, outs[-1].prompt_logprobs)
    single = eng.generate([prompt[:1]], _params())[0]  # nothing to score: [None]
    assert single.prompt_logprobs == [None]


def _spec_engine(tiny_reference, mode: str) -> LLMEngine:
    """A speculative engine of the tiny llama: lookahead or prompt lookup (host worker, or
    state on the device), or the model drafting for itself (verified on the device)."""
    import types

    from kiln.artifact.loader import load_engine
    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.runtime.engine import EngineLimits
    from kiln.sources import make_byte_tokenizer

    kind, where = mode.split("-")
    runtime = RuntimeConfig(device="cpu", block_size=4, max_num_tokens=16,
                            device_speculation=where == "device")
    if kind == "draft":
        t = load_engine(tiny_reference("llama", max_seq_len=256, max_num_tokens=256)[1])
        spec = types.SimpleNamespace(
            generation_defaults=types.SimpleNamespace(values={}),
            speculative=SpeculativeConfig(mode="draft", max_draft_len=3,
                                          draft_model="in-process"))
        weights = t.load_weights("cpu")
        return LLMEngine(t.spec.model, weights, make_byte_tokenizer(),
                         EngineLimits(8, 256, 250, 256), torch.float32, runtime, spec=spec,
                         draft=(t.spec.model, t.load_weights("cpu")))
    cfg = (SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None) if kind == "lookahead"
           else SpeculativeConfig.from_cli("ngram", None, 6, 2))
    _, out = tiny_reference("llama", max_seq_len=256, max_num_tokens=256, max_batch_size=8,
                            speculative=cfg)
    return LLMEngine.from_engine_dir(out, runtime)


@pytest.mark.parametrize("mode", ["lookahead-host", "lookahead-device", "ngram-host",
                                  "ngram-device", "draft-device"])
def test_prompt_logprobs_on_speculative_engines(tiny_reference, mode):
    """Prompt chunks run beside speculative steps of other requests; the scores are the
    plain engine's and the tokens the same as without scoring."""
    model = tiny_reference("llama")[0]
    eng = _spec_engine(tiny_reference, mode)
    # repeats, so the n-gram pool and prompt lookup find drafts
    prompts = [p + p[:6] + p for p in mixed_prompts()[:3]] + mixed_prompts()[3:5]
    params = [_params(n=12) if i % 2 else _params(None, n=12) for i in range(len(prompts))]
    outs = eng.generate(prompts, params)
    plain = eng.generate(prompts, _params(None, n=12))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.metrics.spec_steps for o in outs) > 0
    for prompt, p, out in zip(prompts, params, outs):
        if p.prompt_logprobs is not None:
            _check(model, prompt, out.prompt_logprobs)
    eng.blocks.check_all_free()
