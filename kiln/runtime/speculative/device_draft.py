"""A draft model's device proposer: what its engine keeps on the device so its steps run in
the async pipeline.

A draft-model step whose plans the device verifies (``DraftPlan.device_slot``; requests
without a grammar, at the engine's K) is one chain per request: x, then the K drafts the
draft model drew on the device (written into the plan's rows before the forward).
``DeviceSpecStep`` verifies it after the forward (``commit_step``: the longest prefix of
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

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.speculative.device_step import DeviceProposer, Proposal
from kiln.runtime.speculative.verify import SpecEntries, verify_chains


class DeviceDraft(DeviceProposer):
    """Entry rows of a draft-model engine's device-verified steps (see the module
    docstring). ``num_slots``: the most sequences in a step (entry rows). No per-request
    state: ``admit``, ``fold`` and ``release`` do nothing."""

    name = "draft"
    default_on = True  # on CUDA (RuntimeConfig.device_speculation's comment)

    def __init__(self, num_slots: int, max_draft_len: int, device: torch.device):
        if max_draft_len < 1:
            raise ValueError(f"a draft model drafts at least 1 token a step, got {max_draft_len}")
        self.max_draft_len = max_draft_len
        # T: x and the drafts, the most a step commits; every row verifies
        t = 1 + max_draft_len
        super().__init__(num_slots, t, t, torch.arange(t), device)
        self.last_tokens = torch.zeros(num_slots, self.num_tokens + 1, dtype=torch.long,
                                       device=self.device)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, num_slots: int, max_seq_len: int,
                    device: torch.device) -> DeviceDraft:
        return cls(num_slots, spec.max_draft_len, device)

    def propose_step(self, entries: SpecEntries, input_ids: torch.Tensor) -> Proposal:
        """x and the drafts are in the plans' rows already (``DraftModelWorker.fill``):
        read them back."""
        rows = entries.q0[:, None] + torch.arange(self.num_tokens, device=self.device)
        return Proposal(input_ids[rows.clamp(max=input_ids.shape[0] - 1)].long(), None)

    def commit_step(self, entries: SpecEntries, proposal: Proposal, targets: torch.Tensor,
                    slot_mapping: torch.Tensor, cache: KVCache
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each draft accepted while it equals the row's target, then the target after
        them (a chain: no KV moves); recorded for the next step (``last_tokens``). A sampled
        request's verdict is replaced after the forward (``draft_model.verify_sampled``)."""
        has = entries.slots >= 0
        lens = torch.full_like(entries.slots, self.max_draft_len)
        committed, count = verify_chains(proposal.tokens[:, 1:], lens, targets)
        count = torch.where(has, count, 0)
        b = count.shape[0]
        self.last_tokens[:b, :1].copy_(proposal.tokens[:, :1])
        self.last_tokens[:b, 1:].copy_(committed)
        return committed, count

    def next_inputs(self, num: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For entries 0..num-1 of the step in flight: (the token before the next x and the
        next x [num, 2], each entry's count [num]); no host sync."""
        c = self.last_count[:num]
        idx = torch.stack([c - 1, c], 1).clamp_(min=0, max=self.num_tokens)
        return self.last_tokens[:num].gather(1, idx), c
