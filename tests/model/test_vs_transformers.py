"""kiln greedy == transformers greedy (float32, CPU) on tiny random Llama / Qwen2 / Qwen3.

Also: batch independence under chunked prefill and forced preemption, block accounting,
prefix caching, stop handling. The tiny models use a large init std (0.2) so logits are
far from ties: a mismatch means a real difference, not rounding.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

from kiln.builder import build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.sources.tokenizer import make_byte_tokenizer

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": True}),
}


def _tiny(arch: str, path) -> torch.nn.Module:
    cfg_cls, model_cls, extra = ARCHS[arch]
    cfg = cfg_cls(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, initializer_range=0.2, rope_theta=10000.0,
        bos_token_id=256, eos_token_id=257, **extra,
    )
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    if arch == "qwen2":  # HF initialises biases to zero; make the qkv bias matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(std=0.2)
    model.save_pretrained(path, safe_serialization=True)
    make_byte_tokenizer().save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    """(transformers model, engine dir) for one architecture."""
    src = tmp_path_factory.mktemp(f"hf-{request.param}")
    model = _tiny(request.param, src)
    out = tmp_path_factory.mktemp("engines") / request.param
    build_engine(str(src), out, dtype="float32", max_seq_len=128, max_num_tokens=64,
                 max_batch_size=8, progress=False)
    return model, out


def _prompts(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 30, 9, 40, 3, 22, 11][:n]
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


def _hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_greedy_matches_transformers_alone_and_in_a_preempting_batch(tiny):
    model, engine_dir = tiny
    prompts = _prompts()
    refs = [_hf_greedy(model, p, 24) for p in prompts]
    # Alone: one request at a time on a roomy cache.
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device="cpu"))
    for p, ref in zip(prompts, refs):
        assert eng.generate([p], GREEDY)[0].token_ids == ref
    # Together: 8 mixed-length requests, a 16-token budget (chunked prefill) and a cache far
    # too small for all of them (forced recompute preemption).
    small = LLMEngine.from_engine_dir(
        engine_dir, RuntimeConfig(device="cpu", block_size=4, num_kv_blocks=32,
                                  max_num_tokens=16))
    outs = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
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
