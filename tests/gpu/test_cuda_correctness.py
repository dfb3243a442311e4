"""The runtime on CUDA equals transformers on CUDA (float32, greedy). Skipped without CUDA.

Run on the lent GPU:  python -m pytest -q -s tests/gpu
The smollm2 check prints a table (prompt, tokens compared, equal) for the notes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, mixed_prompts

from kiln.bench.prompts import CHAT_PROMPTS
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers_on_cuda(arch, tiny_reference):
    model, engine_dir = tiny_reference(arch)
    model = model.to("cuda")
    prompts = mixed_prompts()
    refs = [hf_greedy(model, p, 24) for p in prompts]
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        device="cuda", block_size=4, num_kv_blocks=32, max_num_tokens=16))
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    eng.blocks.check_all_free()
    model.to("cpu")


def test_smollm2_first_32_greedy_tokens_match_transformers_on_cuda(smollm2_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    from kiln.builder import build_engine

    out = tmp_path / "smol32"
    build_engine("smollm2-135m", out, dtype="float32", max_seq_len=512, progress=False)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cuda"))
    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).to("cuda").eval()
    prompts = [eng.apply_chat_template([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS[:4]]
    outs = eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    rows = []
    for text, prompt, o in zip(CHAT_PROMPTS, prompts, outs):
        ref = hf_greedy(hf, prompt, 32)
        rows.append((text, len(ref), o.token_ids == ref, o.text[:60].replace("\n", " ")))
    print("\nsmollm2-135m float32 CUDA, kiln vs transformers, first 32 greedy tokens")
    for r in rows:
        print(f"  {r[2]!s:5}  n={r[1]}  {r[0]!r:60} -> {r[3]!r}")
    assert all(r[2] for r in rows)
    eng.blocks.check_all_free()
