"""Prompt-lookup (ngram) drafting: copy what followed the latest earlier occurrence of the
request's last k tokens (k from max_match down to min_match) in its own context."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.request import Request
from kiln.runtime.speculative.device_ngram import DeviceNgram
from kiln.runtime.speculative.draft import DraftPlan
from kiln.runtime.speculative.worker import TreeWorker


class LookupIndex:
    """Prompt lookup's draft (the module docstring's rule, at most ``max_len`` tokens) over a
    growing token list, in O(max_match) per call instead of a scan of the whole text (the
    scan cost ~25 us per call at a few hundred tokens, paid by every proposal and every
    replayed pacing step).

    ``draft(tokens, n)`` is the scan's draft of ``tokens[:n]`` (``find_draft`` in
    tests/helpers.py, the oracle the tests compare it with): the index maps each k-gram
    (min_match <= k <= max_match) to its latest start s whose k-gram has a token after it
    inside tokens[:n] (s + k <= n - 1: a match ends before the suffix starts, as the scan
    requires), so the suffix's entry is the latest earlier occurrence. ``n`` never
    decreases between calls; ``tokens`` only grows (a request's token ids)."""

    def __init__(self, max_match: int, min_match: int, max_len: int) -> None:
        self.max_match, self.min_match, self.max_len = max_match, min_match, max_len
        self._last: dict[tuple[int, ...], int] = {}
        self._n = 0  # tokens[:_n] indexed: every k-gram with s + k <= _n - 1

    def draft(self, tokens: list[int], n: int) -> list[int]:
        last = self._last
        for e in range(max(self._n, 1), n):  # e: the token after the k-grams indexed now
            for k in range(self.min_match, min(self.max_match, e) + 1):
                last[tuple(tokens[e - k : e])] = e - k
        self._n = max(self._n, n)
        for k in range(min(self.max_match, n - 1), self.min_match - 1, -1):
            s = last.get(tuple(tokens[n - k : n]))
            if s is not None:
                return tokens[s + k : min(s + k + self.max_len, n)]
        return []


class LookupShadow:
    """The shadow proposer of prompt lookup (``pace.Shadow``): the draft over the committed
    text up to each step's x (through a ``LookupIndex``)."""

    prior_gain = 1.0  # the worker proposes exactly this (no branch the shadow cannot see)

    def __init__(self, max_match: int, min_match: int, max_len: int) -> None:
        self.depth = max_len
        self.index = LookupIndex(max_match, min_match, max_len)

    def candidates(self, ids: list[int], pos: int) -> list[list[int]]:
        draft = self.index.draft(ids, pos + 1)
        return [draft] if draft else []


@dataclass
class NgramSlot:
    """A prompt-lookup request whose tokens live in a ``DeviceNgram`` slot."""

    slot: int | None
    pending: list[int] = field(default_factory=list)  # committed by plain steps, not on
    # the device yet (folded in before the next device proposal)


class NgramWorker(TreeWorker):
    """Chains of up to ``max_draft_len`` copied tokens, verified causally in one step.

    With a ``DeviceNgram`` (``device``), requests the device can verify (``may_take_slot``:
    greedy or sampled, no grammar) keep their tokens in one of its slots:
    drafting, verification and the history update run on the device around the step's
    forward (``DeviceSpecStep``), one host read per step. The rest, and every request once
    the slots are taken, draft on the host (``LookupIndex``, the oracle the device state is
    tested against)."""

    name = "ngram"

    def __init__(self, max_draft_len: int, max_match: int, min_match: int,
                 device: DeviceNgram | None = None):
        super().__init__(max_draft_len, device)
        self.max_match = max_match
        self.min_match = min_match

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, device: DeviceNgram | None,
                    draft=None) -> NgramWorker:
        return cls(spec.max_draft_len, spec.ngram_max_match, spec.ngram_min_match, device)

    def init_request(self, req: Request, window: tuple[int, int, int]) -> None:
        slot = self.take_slot() if self.may_take_slot(req) else None
        if slot is None:
            req.spec_state = LookupIndex(self.max_match, self.min_match, self.max_draft_len)
            return
        self.admit_to(slot, lambda s: self.device.admit(s, req.prompt_token_ids,
                                                        req.params.seed))
        req.spec_state = NgramSlot(slot)

    def shadow_proposer(self, req: Request) -> LookupShadow:
        return LookupShadow(self.max_match, self.min_match, self.max_draft_len)

    def device_plan(self, req: Request) -> DraftPlan:
        return DraftPlan([req.all_token_ids[-1]] + [0] * self.max_draft_len,
                         device_slot=req.spec_state.slot, **self.device_sampling(req))
