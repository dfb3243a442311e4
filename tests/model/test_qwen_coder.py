"""The real Qwen2.5-Coder built-ins, float32, CPU.

qwen2.5-coder-0.5b (in CI, one 491 MB download cached in KILN_CACHE): kiln greedy ==
transformers greedy (the same GGUF through ``gguf_file=``) for 32 tokens of 3 chat prompts;
a mixed-length batch under chunked prefill gives each request its solo tokens; every weight
of the built engine equals the gguf package's dequantization of the GGUF tensors it comes
from; config, eos ids and chat template come from the GGUF metadata.
qwen2.5-coder-1.5b (1.1 GB): the same greedy check, marked slow and run only with
KILN_TEST_QWEN_1_5B=1 (its float32 transformers model alone needs 7 GB and minutes on 2 cores).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import hf_greedy, module_dir

from kiln.builder import build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.sources.builtin import fetch_builtin

CHATS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "What does the `git rebase` command do? Answer in two sentences.",
    "Explain the difference between a list and a tuple in Python.",
]
GREEDY32 = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
SLOW_15B = pytest.param("qwen2.5-coder-1.5b", marks=[
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("KILN_TEST_QWEN_1_5B") != "1",
                       reason="set KILN_TEST_QWEN_1_5B=1 to run the 1.5B (1.1 GB download)"),
])


def _engine(alias: str, out) -> LLMEngine:
    build_engine(alias, out, dtype="float32", max_seq_len=256, max_num_tokens=512,
                 max_batch_size=8, progress=False)
    return LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))


@pytest.fixture(scope="module")
def qwen05(tmp_path_factory):
    """(engine dir, engine) of qwen2.5-coder-0.5b, float32."""
    with module_dir(tmp_path_factory, "qwen05") as root:
        out = root / "engine"
        yield out, _engine("qwen2.5-coder-0.5b", out)


def _chat_prompts(eng: LLMEngine) -> list[list[int]]:
    return [eng.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


def _hf(alias: str):
    from transformers import AutoModelForCausalLM

    gguf = fetch_builtin(alias, progress=False)
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def _check_greedy(eng: LLMEngine, alias: str) -> None:
    prompts = _chat_prompts(eng)
    outs = eng.generate(prompts, GREEDY32)
    hf = _hf(alias)
    with torch.no_grad():
        refs = [hf_greedy(hf, p, 32) for p in prompts]
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref, (eng.tokenizer.decode(out.token_ids),
                                      eng.tokenizer.decode(ref))
    assert all(eng.tokenizer.decode(o.token_ids).strip() for o in outs)
    eng.blocks.check_all_free()


def test_qwen05_greedy_matches_transformers(qwen05):
    _check_greedy(qwen05[1], "qwen2.5-coder-0.5b")


@pytest.mark.parametrize("alias", [SLOW_15B])
def test_qwen15_greedy_matches_transformers(alias, tmp_path):
    _check_greedy(_engine(alias, tmp_path / "engine"), alias)


def test_qwen05_mixed_batch_gives_solo_tokens(qwen05):
    out, eng = qwen05
    chats = _chat_prompts(eng)
    # 5 requests of 4..~40 tokens: whole chats, a chat's head, raw code
    raw = eng.tokenizer.encode("def fibonacci(n):\n    ", add_special_tokens=False)
    prompts = [chats[0], raw, chats[1][:12], chats[2], raw[:4]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    solo = [eng.generate([p], params)[0].token_ids for p in prompts]
    # a 24-token budget: prefills are chunked and share steps with decodes
    small = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", max_num_tokens=24))
    together = small.generate(prompts, params)
    assert [o.token_ids for o in together] == solo
    small.blocks.check_all_free()


def test_qwen05_engine_weights_equal_gguf_dequantization(qwen05):
    """Each runtime tensor is the concatenation (qkv, gate_up) of the gguf package's own
    dequantization of the GGUF tensors it is made from; qwen2 files are not permuted."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    out, _ = qwen05
    reader = GGUFReader(str(fetch_builtin("qwen2.5-coder-0.5b", progress=False)))
    ref = {t.name: t for t in reader.tensors}

    def deq(name: str) -> np.ndarray:
        t = ref[name]
        return dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])

    fused = {"qkv": ["attn_q", "attn_k", "attn_v"], "gate_up": ["ffn_gate", "ffn_up"],
             "input_norm": ["attn_norm"], "post_norm": ["ffn_norm"], "o_proj": ["attn_output"],
             "down": ["ffn_down"]}
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    seen = set()
    files = sorted(out.glob("*.safetensors"))
    assert files
    for f in files:
        with safe_open(str(f), framework="np") as st:
            for name in st.keys():
                if name in top:
                    parts = [top[name]]
                else:
                    _, i, module, kind = name.split(".")
                    parts = [f"blk.{i}.{g}.{kind}" for g in fused[module]]
                expect = np.concatenate([deq(p) for p in parts], axis=0)
                assert np.array_equal(st.get_tensor(name), expect), name
                seen.update(parts)
    assert seen == set(ref), set(ref) ^ seen  # every GGUF tensor, the untied head included


def test_qwen05_config_tokenizer_and_chat_template(qwen05):
    import json

    from transformers import AutoConfig

    out, eng = qwen05
    gguf = fetch_builtin("qwen2.5-coder-0.5b", progress=False)
    hf = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = json.loads((out / "engine.json").read_text())["model"]
    assert (model["num_layers"], model["hidden_size"], model["num_heads"],
            model["num_kv_heads"], model["vocab_size"]) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.vocab_size) == (24, 896, 14, 2, 151936)
    assert model["qkv_bias"] and model["rope_theta"] == 1e6
    assert model["tie_word_embeddings"] is False  # the GGUF stores its own Q8_0 head
    assert model["eos_token_ids"] == [151645, 151643]  # <|im_end|>, <|endoftext|>
    text = eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("alias", [SLOW_15B])
def test_qwen05_drafting_for_qwen15_equals_plain_greedy(alias, tmp_path):
    """The real pair: qwen2.5-coder-0.5b drafting for 1.5b (`kiln build ... --speculative-
    decoding-mode draft --draft-model qwen2.5-coder-0.5b --max-draft-len 4`, float32): the
    greedy output equals plain greedy on the same engine, and most drafts are accepted (on
    2026-12-04: 3.4-4.5 tokens per step on kiln's bundled prompt sets)."""
    from kiln.artifact.speculative import SpeculativeConfig

    out = tmp_path / "engine"
    build_engine(alias, out, dtype="float32", max_seq_len=256, max_num_tokens=512,
                 max_batch_size=8, progress=False,
                 speculative=SpeculativeConfig.from_cli(
                     "draft", max_draft_len=4, draft_model="qwen2.5-coder-0.5b"))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    prompts = _chat_prompts(eng)
    plain = eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0,
                                                 ignore_eos=True, lookahead=(1, 1, 0)))
    outs = eng.generate(prompts, GREEDY32)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    steps = sum(o.metrics.spec_steps for o in outs)
    assert steps > 0 and sum(o.metrics.spec_tokens for o in outs) > 2 * steps
    eng.blocks.check_all_free()


def test_qwen05_prompt_logprobs_match_transformers(qwen05):
    """Prompt logprobs (what lm-eval's loglikelihood tasks sum) of a 39-token code prompt
    equal transformers' float32 log_softmax over the same tokens within atol 2e-3 (float32
    on both sides, 24 layers summed in different orders), and the 5 alternatives are its
    5 most likely tokens (compared by value: near-ties may swap places)."""
    _, eng = qwen05
    code = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
            "        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n")
    ids = eng.tokenizer.encode(code, add_special_tokens=False)
    assert 30 <= len(ids) <= 45  # 39
    out = eng.generate([ids], SamplingParams(max_tokens=1, temperature=0,
                                             prompt_logprobs=5))[0]
    hf = _hf("qwen2.5-coder-0.5b")
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    del hf
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        row, lp = ref[p - 1], got[p]
        assert lp.token_id == ids[p] and abs(lp.logprob - row[ids[p]].item()) <= 2e-3, p
        top = torch.tensor(list(lp.top.values()))
        assert torch.allclose(top, row.topk(5).values, atol=2e-3), p
        assert torch.allclose(row[list(lp.top)], top, atol=2e-3), p
    eng.blocks.check_all_free()
