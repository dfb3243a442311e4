"""kiln == transformers, greedy, float32, CPU, on the real smollm2-135m (4 prompts x 64)."""

from __future__ import annotations

import pytest
import torch

from kiln.bench.prompts import CHAT_PROMPTS
from kiln.builder import build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

NUM_TOKENS = 64


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("smol") / "engine"
    build_engine("smollm2-135m", out, dtype="float32", max_seq_len=512, progress=False)
    engine = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    return engine, hf


def test_smollm2_greedy_matches_transformers(smol):
    engine, hf = smol
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS[:4]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                          eos_token_id=sorted(engine.eos_token_ids), pad_token_id=0)
        ref_ids = ref[0, len(prompt):].tolist()
        assert out.token_ids == ref_ids, (engine.tokenizer.decode(out.token_ids),
                                          engine.tokenizer.decode(ref_ids))
    assert any(len(o.token_ids) > 16 for o in outs)
    assert all(o.text.strip() for o in outs)
    engine.blocks.check_all_free()
