"""The start-up warm-up (kiln/runtime/warmup.py): which eager shapes it runs, and that running
them leaves no trace (CPU, the Triton path under TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
import torch
from helpers import mixed_prompts

pytest.importorskip("triton")

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.layers.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.warmup import eager_shapes, warm_eager_forward, warm_sampler


def test_eager_shapes_cover_each_query_class_split_and_reduce_width():
    shapes = eager_shapes(max_tokens=8192, capacity=2064)
    assert {(t, s) for t, s, _ in shapes} >= {(1, 1), (1, 2), (2, 1), (2, 2), (64, 1), (64, 2)}
    # 2064 keys over at least 32 per split reach 64 splits: widths 32 and 64 too
    assert (1, 32, False) in shapes and (1, 64, False) in shapes
    assert not any(m for *_, m in shapes)
    small = eager_shapes(max_tokens=32, capacity=256)  # 8 splits at most: width 16 only
    assert {t for t, _, _ in small} == {1, 2} and max(s for _, s, _ in small) == 2
    spec = eager_shapes(max_tokens=8192, capacity=2064, tokens_per_step=84)
    assert {(t, s) for t, s, m in spec if m} == {(84, 1), (84, 2)}


def test_warm_eager_forward_writes_no_kv_and_changes_no_tokens(tiny_reference):
    _, out = tiny_reference(
        "llama", max_seq_len=128, max_num_tokens=256, max_batch_size=8,
        speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))

    def engine():
        return LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", block_size=4, num_kv_blocks=96, max_num_tokens=40,
            attention_backend="triton"))

    prompts = mixed_prompts()[:2]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in engine().generate(prompts, params)]
    eng = engine()
    k0, v0 = eng.cache.k.clone(), eng.cache.v.clone()
    tps = eng.speculative.tokens_per_step
    ran = warm_eager_forward(eng.model, eng.cache, eng.runner.stager, tps)
    assert ran == len(eager_shapes(eng.runner.stager.max_tokens,
                                   eng.runner.stager.max_blocks * 4, tps))
    assert any(s > 1 for _, s, _ in eager_shapes(40, eng.runner.stager.max_blocks * 4, tps))
    assert torch.equal(eng.cache.k, k0) and torch.equal(eng.cache.v, v0)
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    eng.blocks.check_all_free()


def test_warm_sampler_runs_every_policy_on_cpu():
    # on CPU the kernels are not used (CUDA logits only); the torch paths all run
    warm_sampler(Sampler(), 320, torch.device("cpu"))


def test_importing_the_engine_builds_no_kernel():
    # a kernel module builds its kernels at import, compiled or interpreted as TRITON_INTERPRET
    # says then: the engine (and this module, which it imports) must leave that to first use.
    # It may import the kernels' triton-free modules (gemv_configs' routing rules): no
    # triton, no kernel.
    import subprocess
    import sys

    code = ("import sys, kiln.runtime.engine, kiln.runtime.warmup; "
            "print('triton' in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('kiln.runtime.kernels.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.stdout.startswith("False "), out.stdout
