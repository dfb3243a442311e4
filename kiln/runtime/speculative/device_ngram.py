"""Prompt lookup's device proposer: batched drafting, verified as chains (verify.py).

Tensor versions of the host worker's drafting (ngram.py: ``LookupIndex``; the tests' oracle
is the scan ``find_draft`` in tests/helpers.py) and ``TreeWorker.verify``'s greedy branch:
row b here equals the host result for that row exactly. Everything
is pure tensor ops with fixed output shapes and no host syncs, so a step can be captured in
a CUDA graph; the only Python loops run over match lengths and token offsets.
"""

from __future__ import annotations

import torch

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.host_copy import to_device
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.speculative.device_step import DeviceProposer, Proposal
from kiln.runtime.speculative.verify import SpecEntries, StepVerdict, verify_chains


def find_drafts(history: torch.Tensor, lengths: torch.Tensor, max_match: int, min_match: int,
                max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup's draft (ngram.py's rule) for every row of ``history`` [B, L] (entries
    at or past lengths[b] are ignored). Returns (drafts [B, max_len] long, 0 past the draft,
    draft_lens [B] long)."""
    bsz, width = history.shape
    n = lengths.to(device=history.device, dtype=torch.long)
    follow = torch.zeros(bsz, dtype=torch.long, device=history.device)  # draft start
    found = torch.zeros(bsz, dtype=torch.bool, device=history.device)
    for k in range(max_match, min_match - 1, -1):
        num_starts = width - k  # a start s must satisfy s < n - k <= width - k
        if num_starts < 1:
            continue
        # the row's last k tokens; out-of-range rows (n <= k) are clamped and masked below
        suffix_idx = (n[:, None] - k + torch.arange(k, device=history.device)).clamp(min=0)
        suffix = history.gather(1, suffix_idx)
        match = torch.ones(bsz, num_starts, dtype=torch.bool, device=history.device)
        for j in range(k):  # compare the window starting at every s against the suffix
            match &= history[:, j:j + num_starts] == suffix[:, j:j + 1]
        starts = torch.arange(num_starts, device=history.device)
        match &= starts[None, :] < (n - k)[:, None]  # so valid windows end before n - 1
        latest = torch.where(match, starts[None, :], -1).amax(dim=1)
        hit = (latest >= 0) & ~found  # the longest k with any match wins
        follow = torch.where(hit, latest + k, follow)
        found |= hit
    offsets = torch.arange(max_len, device=history.device)
    pos = follow[:, None] + offsets[None, :]
    valid = found[:, None] & (pos < n[:, None])
    drafts = history.gather(1, pos.clamp(max=width - 1)).long()
    drafts = torch.where(valid, drafts, 0)
    return drafts, valid.sum(dim=1)


class DeviceNgram(DeviceProposer):
    """Prompt-lookup state of ``num_slots`` requests on the device: each slot's committed
    tokens (prompt included, the last one is x), from which every step's draft is found.

        history [S, C] int32   the slot's tokens, C = max_seq_len + T (room for a step)
        length  [S]    long    how many of them are real

    One step of a batch of slots at fixed T = 1 + max_draft_len (x, then the draft padded
    with 0; ``draft_lens`` says how much of it is real):

        tokens, draft_lens = state.propose(slots)            # the step's input ids [B, T]
        ... causal forward; argmax of every row [B, T] ...
        verdict = state.verify(tokens, argmax, draft_lens)  # committed [B, T], count [B]
        state.update(slots, tokens, argmax, verdict)         # the history moves on

    Tokens that plain steps of a paced request commit join through ``commit_tokens``.

    ``find_drafts`` above and ``verify.verify_chains`` are the step's math, equal to the host
    worker's (``LookupIndex``, ``TreeWorker.verify``). A chain's accepted rows already sit at
    their final KV indices, so a step moves no KV. ``argmax`` is each row's target token:
    the argmax, or a draw for a sampled request (verify.row_targets). On CUDA the
    kernels of kiln/runtime/kernels/ngram.py run the step (chosen at construction).
    """

    name = "ngram"
    default_on = True  # on CUDA (RuntimeConfig.device_speculation's comment)

    def __init__(self, num_slots: int, max_draft_len: int, max_match: int, min_match: int,
                 capacity: int, device: torch.device):
        if max_draft_len < 1 or not 1 <= min_match <= max_match:
            raise ValueError(f"device prompt lookup needs max_draft_len >= 1 and 1 <= "
                             f"min_match <= max_match, got {max_draft_len}, {min_match}, "
                             f"{max_match}")
        self.max_draft_len, self.max_match, self.min_match = max_draft_len, max_match, min_match
        self.capacity = capacity
        # T: x and the draft, the most a step commits; every row verifies, at its own depth
        # (verify.row_targets)
        t = 1 + max_draft_len
        super().__init__(num_slots, t, t, torch.arange(t), device)
        self.history = torch.zeros(num_slots, capacity, dtype=torch.int32, device=self.device)
        self.length = torch.zeros(num_slots, dtype=torch.long, device=self.device)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, num_slots: int, max_seq_len: int,
                    device: torch.device) -> DeviceNgram:
        return cls(num_slots, spec.max_draft_len, spec.ngram_max_match, spec.ngram_min_match,
                   max_seq_len + spec.tokens_per_step, device)

    def use_kernels(self, on: bool) -> None:
        super().use_kernels(on)
        if on:  # Triton is imported by the engines that run the kernels only
            from kiln.runtime.kernels import ngram as kernels

            self._k = kernels

    def admit(self, slot: int, tokens: list[int], seed: int | None = None) -> None:
        """Load a request's tokens so far (its prompt) into ``slot`` (one pinned copy)."""
        if not 0 < len(tokens) <= self.capacity:
            raise ValueError(f"{len(tokens)} tokens do not fit a device prompt-lookup slot "
                             f"of {self.capacity}")
        self.history[slot, : len(tokens)] = to_device(tokens, torch.int32, self.device)
        self.length[slot] = len(tokens)

    def propose(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's input ids [B, T] (x, then the draft, 0 past it) and the drafts'
        lengths [B]."""
        hist, n = self.history[slots], self.length[slots]
        drafts, lens = find_drafts(hist, n, self.max_match, self.min_match, self.max_draft_len)
        x = hist.gather(1, (n - 1).clamp(min=0)[:, None]).long()
        return torch.cat([x, drafts], 1), lens

    def verify(self, tokens: torch.Tensor, argmax: torch.Tensor, draft_lens: torch.Tensor
               ) -> StepVerdict:
        """Greedy chain verification: committed [B, T] (0 past count), count [B]; no KV
        moves (``src_rows`` None: a chain's accepted rows are where they belong)."""
        committed, count = verify_chains(tokens[:, 1:], draft_lens, argmax)
        return StepVerdict(committed, count, None)

    def update(self, slots: torch.Tensor, tokens: torch.Tensor, argmax: torch.Tensor,
               verdict: StepVerdict) -> None:
        """Fold a verified step into the slots' histories (``commit_tokens`` of what it
        committed)."""
        self.commit_tokens(slots, verdict.committed, verdict.count)

    def commit_tokens(self, slots: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> None:
        """``tokens[b, :count[b]]`` (any width K) join the slots' histories: what a verified
        step committed, or what plain steps of a paced request committed."""
        k = torch.arange(tokens.shape[1], device=self.device)
        n = self.length[slots]
        idx = (n[:, None] + k[None, :]).clamp(max=self.capacity - 1)
        keep = k[None, :] < count[:, None]
        old = self.history[slots[:, None], idx]
        self.history[slots[:, None], idx] = torch.where(keep, tokens.to(torch.int32), old)
        self.length[slots] = n + count

    fold = commit_tokens  # plain steps' tokens: the same few torch ops as a step's

    def propose_step(self, entries: SpecEntries, input_ids: torch.Tensor) -> Proposal:
        if self.kernels:
            return Proposal(*self._k.ngram_propose(
                self.history, self.length, entries.slots, max_match=self.max_match,
                min_match=self.min_match, max_draft_len=self.max_draft_len,
                input_ids=input_ids, q0=entries.q0))
        return self._propose_active(entries, input_ids, self.propose)

    def commit_step(self, entries: SpecEntries, proposal: Proposal, targets: torch.Tensor,
                    slot_mapping: torch.Tensor, cache: KVCache
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain verification and the history update; a chain moves no KV."""
        if self.kernels:
            return self._k.ngram_commit(self.history, self.length, entries.slots,
                                        proposal.tokens, proposal.valid, targets)
        a = proposal.active
        verdict = self.verify(proposal.tokens, targets[a], proposal.valid)
        self.update(entries.slots[a], proposal.tokens, targets[a], verdict)
        return self._scatter(entries, a, verdict.committed, verdict.count)
