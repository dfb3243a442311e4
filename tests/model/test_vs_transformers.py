"""kiln greedy == transformers greedy (float32, CPU) on tiny random Llama / Qwen2 / Qwen3.

Also: batch independence under chunked prefill and forced preemption, block accounting,
prefix caching, stop handling. The tiny models use a large init std (0.2) so logits are
far from ties: a mismatch means a real difference, not rounding.
"""

from __future__ import annotations

import pytest
from helpers import hf_greedy, mixed_prompts

from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tiny_reference):
    """(transformers model, engine dir) for one architecture."""
    return tiny_reference(request.param)

def _prompts():
    return mixed_prompts()


def test_greedy_matches_transformers_alone_and_in_a_preempting_batch(tiny):
    model, engine_dir = tiny
    prompts = _prompts()
    refs = [hf_greedy(model, p, 24) for p in prompts]
    # Alone: one request at a time on a roomy cache.
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    for p, ref in zip(prompts, refs):
        assert eng.generate([p], GREEDY)[0].token_ids == ref
    # Together: 8 mixed-length requests, a 16-token budget (chunked prefill) and a cache far
    # too small for all of them (forced recompute preemption), in either KV layout.
    for layout in ("NHD", "HND"):
        small = LLMEngine.from_engine_dir(
            engine_dir, RuntimeConfig(device="cpu", block_size=4, num_kv_blocks=32,
                                      reserve_kv=False, max_num_tokens=16, kv_layout=layout))
        assert small.runner.cache.layout == layout
        outs = small.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == refs, layout
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        small.blocks.check_all_free()


def test_abort_frees_every_block(tiny):
    _, engine_dir = tiny
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu", block_size=4))
    ids = [eng.add_request(p, GREEDY) for p in _prompts()]
    for _ in range(3):
        eng.step()
    for rid in ids[::2]:
        eng.abort(rid)
    while eng.has_unfinished_requests():
        eng.step()
    eng.blocks.check_all_free()


def test_prefix_cache_reuses_blocks_and_gives_identical_output(tiny):
    _, engine_dir = tiny
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu", block_size=4))
    prompt = _prompts()[4]  # 40 tokens
    first = eng.generate([prompt], GREEDY)[0]
    again = eng.generate([prompt], GREEDY)[0]
    assert first.metrics.num_cached_prompt_tokens == 0
    assert again.metrics.num_cached_prompt_tokens == 36  # 9 full blocks; last token recomputed
    assert again.token_ids == first.token_ids
    eng.blocks.check_all_free()


def test_stop_token_eos_and_stop_strings(tiny):
    _, engine_dir = tiny
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    prompt = _prompts()[1]
    free = eng.generate([prompt], GREEDY)[0]
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == free.token_ids[: first + 1]
    # A stop string cut from the free-running text ends generation before it.
    text = free.text
    if len(text) > 6:
        stop = text[3:6]
        out = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                    stop=[stop]))[0]
        assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    limited = eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    assert limited.finish_reason == "length" and len(limited.token_ids) == 3


def test_streamed_deltas_add_up_to_the_final_text(tiny):
    _, engine_dir = tiny
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    parts, ids, last = [], [], None
    for out in eng.stream("hello kiln", SamplingParams(max_tokens=12, temperature=0,
                                                      ignore_eos=True)):
        parts.append(out.new_text)
        ids.extend(out.new_token_ids)
        last = out
    assert last.finished and "".join(parts) == last.text and ids == last.token_ids


def test_seeded_sampling_reproducible_across_batches(tiny):
    _, engine_dir = tiny
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    alone = eng.generate([_prompts()[0]], sp)[0].token_ids
    batch = eng.generate(_prompts(), [sp] + [GREEDY] * 7)
    assert batch[0].token_ids == alone


def test_bad_requests_are_rejected_with_a_message(tiny):
    _, engine_dir = tiny
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    with pytest.raises(ValueError, match="max_input_len"):
        eng.add_request(list(range(200)), GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([5, 100000], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], GREEDY)
    assert not eng.has_unfinished_requests()
