"""Tiny float32 Qwen2 (q/k/v biases, rope theta 1e6 shape of the real models' config) on the
"triton" attention backend under TRITON_INTERPRET=1 gives the "torch" backend's and
transformers' greedy tokens, alone and in a chunked-prefill batch.
(tests/unit/test_kernels_engine.py covers the same path on tiny llama with lookahead.)"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
from helpers import hf_greedy, mixed_prompts

pytest.importorskip("triton")

from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams


def test_tiny_qwen2_triton_backend_equals_torch_and_transformers(tiny_reference):
    model, out = tiny_reference("qwen2")
    assert model.config.model_type == "qwen2"
    prompts = mixed_prompts()[:4]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    refs = [hf_greedy(model, p, 8) for p in prompts]
    for backend in ("torch", "triton"):
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", block_size=4, num_kv_blocks=64, max_num_tokens=16,
            attention_backend=backend))
        assert [o.token_ids for o in eng.generate(prompts, params)] == refs, backend
        eng.blocks.check_all_free()
