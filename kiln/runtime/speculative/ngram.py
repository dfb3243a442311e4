"""Prompt-lookup (ngram) drafting: copy what followed the latest earlier occurrence of the
request's last k tokens (k from max_match down to min_match) in its own context."""

from __future__ import annotations

import torch

from kiln.runtime.layers.sampler import warp
from kiln.runtime.request import Request
from kiln.runtime.speculative.draft import DraftPlan
from kiln.runtime.speculative.lookahead_math import verify_position
from kiln.runtime.speculative.worker import DraftWorker


def find_draft(tokens: list[int], max_match: int, min_match: int, max_len: int) -> list[int]:
    """Tokens following the most recent earlier match of the longest suffix (<= max_len)."""
    n = len(tokens)
    for k in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = tokens[n - k :]
        # scan right to left; a match must end before the suffix itself starts at n-k
        for start in range(n - k - 1, -1, -1):
            if tokens[start : start + k] == suffix:
                follow = tokens[start + k : start + k + max_len]
                if follow:
                    return follow
    return []


class LookupShadow:
    """The shadow proposer of prompt lookup (``pace.Shadow``): ``find_draft`` over the
    committed text up to each step's x."""

    def __init__(self, max_match: int, min_match: int, max_len: int) -> None:
        self.max_match, self.min_match, self.depth = max_match, min_match, max_len

    def candidates(self, ids: list[int], pos: int) -> list[list[int]]:
        draft = find_draft(ids[: pos + 1], self.max_match, self.min_match, self.depth)
        return [draft] if draft else []


class NgramWorker(DraftWorker):
    """Chains of up to ``max_draft_len`` copied tokens, verified causally in one step."""

    name = "ngram"

    def __init__(self, max_draft_len: int, max_match: int, min_match: int):
        super().__init__()
        self.max_draft_len = max_draft_len
        self.max_match = max_match
        self.min_match = min_match

    def init_request(self, req: Request, window: tuple[int, int, int]) -> None:
        req.spec_state = True

    def shadow_proposer(self, req: Request) -> LookupShadow:
        return LookupShadow(self.max_match, self.min_match, self.max_draft_len)

    def propose(self, req: Request) -> DraftPlan | None:
        draft = find_draft(req.all_token_ids, self.max_match, self.min_match,
                           self.max_draft_len)
        if not draft:
            return None
        return DraftPlan([req.all_token_ids[-1]] + draft, data=draft)

    def verify(self, req: Request, logits: torch.Tensor, argmax: list[int]
               ) -> tuple[list[int], list[tuple[int, int]]]:
        draft: list[int] = req.draft.data
        accepted: list[int] = []
        if req.matcher is not None:  # structured output: drafts checked against the grammar
            accepted = self.guided_chain(req, logits, draft, list(range(1, len(draft) + 1)))
        elif req.params.greedy:
            for i, d in enumerate(draft):
                if argmax[i] != d:
                    break
                accepted.append(d)
            accepted.append(argmax[len(accepted)])
        else:
            for i, d in enumerate(draft):
                tok, idx = verify_position(warp(logits[i], req.params), [d], req.generator)
                accepted.append(tok)
                if idx is None:
                    break
            else:
                tok, _ = verify_position(warp(logits[len(draft)], req.params), [],
                                         req.generator)
                accepted.append(tok)
        return accepted, []  # a chain: accepted rows already sit at their final indices
