"""Batched, device-side prompt-lookup (ngram) drafting and greedy chain verification.

Tensor versions of ``find_draft`` and ``NgramWorker.verify``'s greedy branch in ngram.py,
which stays the oracle: row b here equals the host result for that row exactly. Everything
is pure tensor ops with fixed output shapes and no host syncs, so both functions can be
captured in a CUDA graph; the only Python loops run over match lengths and token offsets.
"""

from __future__ import annotations

import torch


def find_drafts(history: torch.Tensor, lengths: torch.Tensor, max_match: int, min_match: int,
                max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``find_draft`` for every row of ``history`` [B, L] (entries at or past lengths[b] are
    ignored). Returns (drafts [B, max_len] long, 0 past the draft, draft_lens [B] long)."""
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


def verify_chains(drafts: torch.Tensor, draft_lens: torch.Tensor, argmax: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain verification for a batch: argmax [B, D+1] holds the model's token after
    each draft prefix. Returns (accepted [B, D+1] long, 0 past counts, counts [B] long)."""
    d = drafts.shape[1]
    idx = torch.arange(d + 1, device=argmax.device)
    ok = (argmax[:, :d] == drafts) & (idx[None, :d] < draft_lens[:, None])
    num_matched = ok.long().cumprod(dim=1).sum(dim=1)
    # accepted drafts equal argmax at their rows, and the bonus token is argmax[num_matched]
    accepted = torch.where(idx[None, :] <= num_matched[:, None], argmax.long(), 0)
    return accepted, num_matched + 1
