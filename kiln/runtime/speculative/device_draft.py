"""What a draft-model engine keeps on the device so its steps run in the async pipeline.

A draft-model step whose plans the device verifies (``DraftPlan.device_slot``; requests
without a grammar, at the engine's K) is one chain per request: x, then the K drafts the
draft model drew on the device (written into the plan's rows before the forward).
``DeviceSpecStep`` verifies it after the forward (``verify_chains``: the longest prefix of
drafts equal to the target's argmax, then the target's token after it; a sampled
request's verdict is then replaced by the standard rule's, ``draft_model.verify_sampled``)
and keeps,
per entry row of the step, what the next step launched ahead needs before the host has
read this one:

    last_tokens [S, K + 2]  x, then what the step committed (0 past its count)
    last_count  [S]         how many it committed (``DeviceSpecStep.last_count``)

The next step's draft starts from the token before its x and its x,
``last_tokens[e, c - 1]`` and ``last_tokens[e, c]`` (c = ``last_count[e]``), at positions
the device moves on by c - 1 (``DraftModel.draft_ahead``): two tokens, whatever the step
accepted, because the draft has KV for x and every accepted draft but the K-th.
"""

from __future__ import annotations

import torch


class DeviceDraft:
    """Entry rows of a draft-model engine's device-verified steps (see the module
    docstring). ``num_slots``: the most sequences in a step (entry rows)."""

    def __init__(self, num_slots: int, max_draft_len: int, device: torch.device):
        if max_draft_len < 1:
            raise ValueError(f"a draft model drafts at least 1 token a step, got {max_draft_len}")
        self.num_slots = num_slots
        self.max_draft_len = max_draft_len
        self.num_tokens = 1 + max_draft_len  # T: x and the drafts
        self.commit_width = 1 + max_draft_len  # the most a step commits
        self.device = torch.device(device)
        self.verify_offsets = torch.arange(self.num_tokens, device=self.device)
        self.last_tokens = torch.zeros(num_slots, self.num_tokens + 1, dtype=torch.long,
                                       device=self.device)
        self.last_count = torch.ones(num_slots, dtype=torch.long, device=self.device)

    def record(self, tokens: torch.Tensor, committed: torch.Tensor, count: torch.Tensor
               ) -> None:
        """A verified step's entries (rows 0..B-1): its plans' tokens [B, T] (x first),
        what each committed [B, T] and how many [B] (0: no plan)."""
        b = count.shape[0]
        self.last_tokens[:b, :1].copy_(tokens[:, :1])
        self.last_tokens[:b, 1:].copy_(committed)
        self.last_count[:b].copy_(count)

    def next_inputs(self, num: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For entries 0..num-1 of the step in flight: (the token before the next x and the
        next x [num, 2], each entry's count [num]); no host sync."""
        c = self.last_count[:num]
        idx = torch.stack([c - 1, c], 1).clamp_(min=0, max=self.num_tokens)
        return self.last_tokens[:num].gather(1, idx), c
