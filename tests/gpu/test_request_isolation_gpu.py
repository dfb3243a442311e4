"""On CUDA (graphs, sampling kernels, async steps): a NaN logits row fails its request alone.

The sampling kernel marks the row INVALID_TOKEN (-1); the step launched ahead on top of it
reads that token as its input through a clamp (a -1 embedding index would be a device-side
assert: the end of the engine for everyone). The victim ends with finish_reason "error", the
other requests' tokens equal a fault-free run, every KV block returns, the device still works.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="compiled kernels, not the interpreter"),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_nan_row_fails_its_request_alone_with_graphs_and_async_steps(tmp_path, monkeypatch,
                                                                        temperature):
    from helpers import count_launches

    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    out = tmp_path / "e"
    build_engine("random:smollm2-135m", out, dtype="bfloat16", max_seq_len=512,
                 max_num_tokens=1024, max_batch_size=8, progress=False)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cuda"))
    assert eng.runner.graphs is not None and eng.async_scheduling
    prompts = [[100 + (7 * i + j) % 900 for i in range(16 + j)] for j in range(4)]
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=None if
                             temperature == 0 else 11 + j, ignore_eos=True) for j in range(4)]
    ref = [o.token_ids for o in eng.generate(prompts, params)]  # seeded: reproducible
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    victim = eng._requests[ids[1]]
    real_exec = eng.runner.execute
    def nan_row(batch, *args):
        fwd = real_exec(batch, *args)
        row = fwd.sample_rows.get(victim)
        if row is not None and len(victim.output_token_ids) >= 4:
            with torch.inference_mode():
                fwd.logits[row] = float("nan")
        return fwd

    monkeypatch.setattr(eng.runner, "execute", nan_row)
    launched_ahead = count_launches(eng)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    torch.cuda.synchronize()  # the device still works: no device-side assert
    assert done[ids[1]].finish_reason == "error" and "NaN" in done[ids[1]].error
    for i in (0, 2, 3):
        assert done[ids[i]].token_ids == ref[i], i
    assert launched_ahead[0] > 0
    eng.blocks.check_all_free()
