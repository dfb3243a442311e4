"""Limits that used to crash the CUDA graph path work: max_batch_size above max_seq_len.

A decode bucket holds up to max_batch_size tokens and its padding sequence takes the
leftover ones as its context, reading its block-table row that deep; rows covered only
max_seq_len + 1 tokens, so capturing the largest bucket (its dummy step: the padding
sequence takes all of it) read past the row: an illegal memory access on CUDA. Off CUDA
(TRITON_INTERPRET=1) the graph path runs the same static-buffer forward eagerly.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest

pytest.importorskip("triton")

from kiln.builder import build_engine
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams


def test_batch_larger_than_max_seq_len_builds_and_runs_on_the_graph_path(tmp_path):
    out = tmp_path / "e"
    build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=32, max_batch_size=64,
                 max_num_tokens=256, progress=False)

    def engine(backend: str) -> LLMEngine:
        return LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", attention_backend=backend, cuda_graphs=backend == "triton"))

    eng = engine("triton")
    graphs, stager = eng.runner.graphs, eng.runner.stager
    assert eng.scheduler.max_num_seqs == 64
    top = max((b for b in graphs.buckets if not b.masked), key=lambda b: b.num_tokens)
    assert top.num_tokens == 64 <= stager.max_blocks * stager.block_size
    # what CudaGraphRunner.capture runs before recording the bucket: the padding sequence
    # holds all 64 tokens, its context 64 deep in its block-table row
    stager.fill_dummy(top.num_seqs, top.num_tokens)
    graphs._forward(top)
    # 8 prompts (prefilled in the 48-token decode bucket), then decoding in the 8 bucket
    prompts = [[(7 * i + j) % 250 for j in range(3 + i % 5)] for i in range(8)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert graphs.num_replays > 0
    eng.blocks.check_all_free()
    assert got == [o.token_ids for o in engine("torch").generate(prompts, params)]
