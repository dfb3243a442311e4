"""kiln/runtime/host_copy.py: small host lists onto the device (CPU here; the GPU path is the
same call through pinned memory, exercised by the seeded-sampling and engine GPU tests)."""

from __future__ import annotations

import torch

from kiln.runtime.host_copy import to_device


def test_values_and_dtype_survive_the_copy():
    keys = [0, 2**40 + 3, 2**62 - 1]
    out = to_device(keys, torch.int64, torch.device("cpu"))
    assert out.dtype == torch.int64 and out.tolist() == keys
    inv = to_device([0.0, 1.25], torch.float32, torch.device("cpu"))
    assert inv.dtype == torch.float32 and inv.tolist() == [0.0, 1.25]
