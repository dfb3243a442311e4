"""The real smollm2-135m, float32, CPU: kiln == transformers greedy (4 prompts x 64), and
lookahead / ngram greedy == plain greedy for several windows.

One engine is built with the lookahead window (7,7,7); every smaller window runs on it as
a per-request window, all in one continuous batch. CPU time bounds the sizes here: the
small windows run 4 prompts x 128 tokens, (5,5,5) and (7,7,7) (40 and 84 tokens per step)
2 prompts x 64. tests/gpu/test_cuda_correctness.py runs every window at 4 x 128 on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from helpers import module_dir

from kiln.artifact.speculative import SpeculativeConfig
from kiln.bench.prompts import CHAT_PROMPTS, CODE_PROMPTS
from kiln.builder import build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

PLAIN = (1, 1, 0)
WINDOWS = [(2, 2, 1), (4, 3, 4), (5, 5, 5), (7, 7, 7), (3, 2, 3)]
BIG = {(5, 5, 5), (7, 7, 7)}


def _build(out, speculative):
    build_engine("smollm2-135m", out, dtype="float32", max_seq_len=512, max_num_tokens=4096,
                 max_batch_size=32, speculative=speculative, progress=False)
    return LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    with module_dir(tmp_path_factory, "smol") as root:
        yield _build(root / "engine", SpeculativeConfig.from_cli("lookahead", "7,7,7", None, None))


@pytest.fixture(scope="module")
def prompts(smol):
    texts = [CODE_PROMPTS[0], CHAT_PROMPTS[0], CODE_PROMPTS[2], CHAT_PROMPTS[2]]
    return [smol.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


@pytest.fixture(scope="module")
def plain128(smol, prompts):
    params = SamplingParams(max_tokens=128, temperature=0, lookahead=PLAIN)
    return [o.token_ids for o in smol.generate(prompts, params)]


def test_smollm2_greedy_matches_transformers(smol, prompts, smollm2_gguf):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    outs = smol.generate(prompts, SamplingParams(max_tokens=64, temperature=0, lookahead=PLAIN))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                          eos_token_id=sorted(smol.eos_token_ids), pad_token_id=0)
        ref_ids = ref[0, len(prompt):].tolist()
        assert out.token_ids == ref_ids, (smol.tokenizer.decode(out.token_ids),
                                          smol.tokenizer.decode(ref_ids))
    assert any(len(o.token_ids) > 16 for o in outs)
    assert all(o.text.strip() for o in outs)
    smol.blocks.check_all_free()


def test_smollm2_lookahead_equals_plain_greedy(smol, prompts, plain128):
    # Every window on every prompt, all in one continuous batch.
    jobs = [(w, i) for w in WINDOWS for i in range(2 if w in BIG else len(prompts))]
    params = [SamplingParams(max_tokens=64 if w in BIG else 128, temperature=0, lookahead=w)
              for w, _ in jobs]
    outs = smol.generate([prompts[i] for _, i in jobs], params)
    for (w, i), o in zip(jobs, outs):
        assert o.token_ids == plain128[i][: len(o.token_ids)], (w, i)
        assert len(o.token_ids) == min(len(plain128[i]), 64 if w in BIG else 128)
    per_window = {
        w: sum(o.metrics.spec_tokens for (ww, _), o in zip(jobs, outs) if ww == w)
        / sum(o.metrics.spec_steps for (ww, _), o in zip(jobs, outs) if ww == w)
        for w in WINDOWS
    }
    assert all(v > 1.0 for v in per_window.values()), per_window  # real acceptance
    smol.blocks.check_all_free()


def test_smollm2_ngram_equals_plain_greedy(smollm2_gguf, prompts, plain128, tmp_path):
    eng = _build(tmp_path / "ngram", SpeculativeConfig.from_cli("ngram", None, 8, 3))
    outs = eng.generate(prompts, SamplingParams(max_tokens=128, temperature=0))
    assert [o.token_ids for o in outs] == plain128
    assert sum(o.metrics.spec_steps for o in outs) > 0
    eng.blocks.check_all_free()
