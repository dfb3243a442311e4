"""The activation dtypes an engine may be built in (engine.json's ``dtype``), by name."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
