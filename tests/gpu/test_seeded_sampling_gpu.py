"""Seeded requests on CUDA: drawn by the sampling kernels with Philox keys from the request's
own generator (no host draw), reproducible, and independent of the batch around them."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="compiled kernels, not the interpreter"),
]


def test_seeded_requests_draw_on_the_device_and_reproduce_in_any_batch(tmp_path, monkeypatch):
    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.layers import sampler
    from kiln.runtime.sampling_params import SamplingParams

    out = tmp_path / "e"
    build_engine("random:smollm2-135m", out, dtype="bfloat16", max_seq_len=512,
                 max_num_tokens=1024, max_batch_size=8, progress=False)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cuda"))

    def no_host_draw(*a, **k):
        raise AssertionError("a seeded row was drawn on the host")

    monkeypatch.setattr(sampler, "sample_row", no_host_draw)
    prompt = [100 + (7 * i) % 900 for i in range(24)]

    def seeded(seed: int, temperature: float = 1.0) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=temperature, seed=seed,
                              ignore_eos=True)

    alone = eng.generate([prompt], seeded(5))[0].token_ids
    assert eng.generate([prompt], seeded(5))[0].token_ids == alone  # reproducible
    others = [SamplingParams(max_tokens=30, temperature=t, ignore_eos=True) for t in (0, 0.7)]
    batch = eng.generate([prompt[::-1], prompt, prompt[3:], prompt],
                         [others[0], seeded(5), others[1], seeded(6, 0.9)])
    assert batch[1].token_ids == alone  # the batch around it changes nothing
    assert batch[3].token_ids != alone  # another seed (and temperature) draws otherwise
    assert eng.generate([prompt], seeded(6))[0].token_ids != alone
    eng.blocks.check_all_free()
