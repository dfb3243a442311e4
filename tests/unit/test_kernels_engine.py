"""The engine on the "triton" attention backend (CPU, TRITON_INTERPRET=1) equals "torch".

Tiny float32 llama, greedy lookahead: chunked prefill, tree-masked speculative steps and
their KV moves, over blocks of 4, must give the torch backend's tokens.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
from helpers import mixed_prompts

pytest.importorskip("triton")

from kiln.builder.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams


def _tokens(engine_dir, backend, prompts, params, graphs=False):
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        device="cpu", block_size=4, num_kv_blocks=96, max_num_tokens=40,
        attention_backend=backend, cuda_graphs=graphs))
    outs = eng.generate(prompts, params)
    eng.blocks.check_all_free()
    if graphs:  # the static-buffer (graph) path ran decode and speculative steps
        g = eng.runner.graphs
        assert g is not None and g.num_replays > 0
        assert any(b.masked for b in g.buckets) and any(not b.masked for b in g.buckets)
    return [o.token_ids for o in outs], sum(o.metrics.spec_steps for o in outs)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_triton_backend_engine_greedy_and_lookahead(tiny_reference, graphs):
    _, out = tiny_reference(
        "llama", max_seq_len=128, max_num_tokens=256, max_batch_size=8,
        speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))
    # one prompt long enough to be prefilled in chunks (max_num_tokens 40), with repeats so
    # the n-gram pool finds drafts; one short
    prompts = [p + p[:6] + p for p in mixed_prompts()[1:2]] + [mixed_prompts()[0]]
    # the second request decodes plainly and outlives the first: mixed steps, then decode
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, lookahead=(4, 3, 4)),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, lookahead=(1, 1, 0))]
    ref, ref_spec_steps = _tokens(out, "torch", prompts, params)
    got, spec_steps = _tokens(out, "triton", prompts, params, graphs)
    assert got == ref
    assert spec_steps > 0 and spec_steps == ref_spec_steps
