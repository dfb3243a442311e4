"""Build-time kernel tuning on CUDA: tune paged_attention for a small model, install the
section, and the tuned launch equals the default one (bf16 rounding). Skipped without CUDA.

Run alone (not after the CPU-interpreter kernel tests):
    python -m pytest -q -s tests/gpu/test_kernel_tuning_gpu.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="TRITON_INTERPRET is set in this process; run tests/gpu alone"),
]


def test_tuned_paged_attention_equals_default():
    from kiln.artifact.spec import Limits
    from kiln.runtime.kernels import tunables, tuning
    from kiln.runtime.kernels.paged_attention import (
        default_config,
        paged_attention,
        paged_attention_ref,
    )
    from kiln.runtime.kernels.testing import rel_err
    from kiln.sources.random import PRESETS

    model = PRESETS["smollm2-135m"]  # 9 heads, 3 kv heads, head_dim 64
    limits = Limits(max_batch_size=8, max_seq_len=1024, max_num_tokens=256)
    kw = {"tokens_per_step": 16, "tree_mask": True}  # a lookahead step (4,3,4)
    section = tuning.tune(model, limits, torch.bfloat16, "cuda", kernels=["paged_attention"],
                          **kw)
    print("\ntune_s", section["tune_s"], "skipped", section["skipped"], "rejected",
          section["rejected"])
    print(json.dumps(section["configs"], indent=1))
    print(json.dumps(section["stats"], indent=1))
    assert section["tuned"] and section["gpu"] == torch.cuda.get_device_name()
    configs = section["configs"]["paged_attention"]
    # a tree-masked speculative step is a query class of its own (paged_attention.query_class)
    assert sorted(k.rsplit("-", 1)[1] for k in configs) == ["decode", "tree"]

    pa = tuning.registered()["paged_attention"]
    target = tuning.TuneTarget(model, limits, torch.bfloat16, **kw)
    tuning.install(section, "cuda")
    try:
        for p in pa.problems(target):
            key = pa.key(p)
            assert tuning.lookup("paged_attention", key) == configs[key]
            b, _, _, _ = tunables._attention_inputs(p, torch.device("cuda"))
            args = (*b.args(), p["head_dim"] ** -0.5)
            kwargs = dict(max_query_len=b.max_query_len, max_context_len=b.max_context_len,
                          **b.kwargs())
            tuned = paged_attention(*args, **kwargs)  # looks the tuned config up
            default = paged_attention(*args, config=default_config(p["head_dim"]), **kwargs)
            assert tuning.close(tuned, default), (key, configs[key])
            assert rel_err(tuned, default) < 1e-2
            ref = paged_attention_ref(*args, mask=b.mask, mask_offsets=b.mask_offsets)
            assert rel_err(tuned, ref) < 1e-2
    finally:
        tuning.clear()
        tunables._release()
