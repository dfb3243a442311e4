"""What a speculative worker proposes for one request's next step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

NO_WARP = (0.0, 1.0, 0.0)  # a plan's (top_k, top_p, min_p) without any of them


@dataclass
class DraftPlan:
    """The tokens one request feeds in its next step: x (the last committed token) first.

    ``position_offsets`` [T] (offset from x's position; None = 0..T-1, a chain) and
    ``step_mask`` [T, T] bool (None = causal) describe the in-step tree. Row ``r`` writes
    its KV at the request's token index ``p + r`` (p = x's position); the worker moves the
    accepted rows' KV to their final indices afterwards. ``data`` is the worker's own.

    ``device_slot``: the plan is proposed and verified on the device, from this slot of
    the engine's ``DeviceLookahead``, around the step's forward (the model runner's
    ``DeviceSpecStep``); ``token_ids`` then holds x and placeholders, and ``inv_temp`` (0:
    greedy), ``key`` and ``warp`` (top_k, top_p, min_p) say how the device verifies it
    (``SpecEntries``).
    """

    token_ids: list[int]
    position_offsets: torch.Tensor | None = None
    step_mask: torch.Tensor | None = None
    data: Any = None
    device_slot: int | None = None
    inv_temp: float = 0.0
    key: int = 0
    warp: tuple[float, float, float] = NO_WARP

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
