"""Lookahead decoding worker (Fu et al. 2024; TensorRT-LLM's algorithm; LOOKAHEAD.md).

Per request: a Jacobi window of W columns x (N-1) levels seeded from prompt tokens, an
n-gram pool keyed by first token (at most G per key, seeded with the prompt's n-grams and
fed with committed output). Each step feeds x, the window and up to G pool candidates in
one forward with a tree mask; the longest verified candidate prefix plus the bonus token
is committed and only its KV is kept.

Simplification vs the paper: all levels are seeded from the prompt at once (no N-2 warm-up
steps with a growing window), so every step has the same shape. Output is unaffected:
verification alone decides what is committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.request import Request
from kiln.runtime.speculative.device_lookahead import DeviceLookahead
from kiln.runtime.speculative.draft import DraftPlan
from kiln.runtime.speculative.lookahead_math import (
    POOL_BUCKETS,
    NgramPool,
    StepLayout,
    initial_window,
    step_layout,
    with_lookup,
)
from kiln.runtime.speculative.ngram import LookupIndex
from kiln.runtime.speculative.pace import PRIOR_GAIN
from kiln.runtime.speculative.verify import walk_tree
from kiln.runtime.speculative.worker import DraftWorker


@dataclass
class LookaheadState:
    """One request's window and pool. ``window[l][j]``: level l, column j (level 0 col 0 is
    refreshed with x at every proposal)."""

    w: int
    n: int
    g: int
    window: list[list[int]]
    pool: NgramPool | None
    slot: int | None = None  # the DeviceLookahead slot holding this state (window, pool)
    fed: int = 0  # the host pool holds the committed n-grams ending before this index
    pending: list[int] = field(default_factory=list)  # committed by plain steps, not on
    # the device yet (folded in before the next device proposal)
    lookup: LookupIndex | None = None  # the prompt-lookup candidate's index (host state)

    def layout(self, g_actual: int) -> StepLayout:
        return step_layout(self.w, self.n, g_actual)  # shared by all requests


def warm_layouts(window: tuple[int, int, int]) -> None:
    """Build the step layouts (and their row lists) of a window for every candidate count
    0..G, so no request pays for them inside its decode steps (engine start-up)."""
    w, n, g = window
    for g_actual in range(g + 1):
        step_layout(w, n, g_actual).row_lists


class PoolShadow:
    """The shadow proposer of lookahead (``pace.Shadow``): the candidates the request's
    n-gram pool would offer at each step if it held only the prompt's n-grams and those of
    the committed text (the lookahead branch's are what the shadow cannot see)."""

    prior_gain = PRIOR_GAIN  # what the lookahead branch's n-grams add

    def __init__(self, n: int, g: int, prompt: list[int],
                 match: tuple[int, int] = (3, 1)) -> None:
        self.n, self.g = n, g
        self.depth = n - 1
        self.pool = NgramPool(n, g, POOL_BUCKETS)
        self.pool.seed_from_tokens(prompt)
        self._fed = len(prompt)  # n-grams ending before this index are in the pool
        self.lookup = LookupIndex(*match, n - 1)

    def candidates(self, ids, pos: int) -> list[tuple[int, ...]]:
        if self._fed <= pos:  # the n-grams a step at pos has seen: up to its x
            self.pool.add_from(ids, self._fed, pos + 1)
            self._fed = pos + 1
        return with_lookup(self.pool.candidates(ids[pos], self.g),
                           self.lookup.draft(ids, pos + 1), self.n - 1, self.g)


def verify_candidates(req: Request, logits: torch.Tensor, argmax: list[int],
                      cands: list[tuple[int, ...]], cand_rows: list[list[int]]
                      ) -> tuple[list[int], list[tuple[int, int]]]:
    """A lookahead step's candidates verified as one token tree (``walk_tree``: candidates
    that share a prefix share its first holder's rows): (committed tokens, KV moves). The
    accepted drafts' KV comes from the first candidate that holds them all, the one the
    device's ``verify_tree`` picks (the first of the longest matches)."""
    kids: dict[int, dict[int, int]] = {}
    for cand, rows in zip(cands, cand_rows):
        row = 0
        for tok, r in zip(cand, rows):
            row = kids.setdefault(row, {}).setdefault(tok, r)
    accepted, _, m = walk_tree(req, logits, argmax, kids)
    if not m:
        return accepted, []
    best = next(i for i, c in enumerate(cands) if list(c[:m]) == accepted[:m])
    return accepted, [(cand_rows[best][k], k + 1) for k in range(m)]


class LookaheadWorker(DraftWorker):
    """Proposes lookahead steps and verifies them (greedy or sampled).

    With a ``DeviceLookahead`` (``device``), requests at its window that the device can
    verify (``may_take_slot``: greedy or sampled, no grammar) keep their
    window and pool in one of its slots: proposal, verification, the state update and the KV
    move of accepted rows run on the device around the step's forward (the model runner's
    ``DeviceSpecStep``, inside a masked bucket's CUDA graph), one host read per step
    (``propose_batch`` / ``verify_on_device``). The rest, and every request once the slots
    are taken, use the host state (the oracle the device state is tested against).
    """

    name = "lookahead"

    def __init__(self, device: DeviceLookahead | None = None,
                 match: tuple[int, int] = (3, 1)) -> None:
        super().__init__(device)
        self.match = match  # (longest, shortest) n-gram of the prompt-lookup candidate

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, device: DeviceLookahead | None,
                    draft=None) -> LookaheadWorker:
        warm_layouts(spec.lookahead)  # the engine's window; other windows build on first use
        return cls(device, (spec.ngram_max_match, spec.ngram_min_match))

    def init_request(self, req: Request, window: tuple[int, int, int]) -> None:
        w, n, g = window
        prompt = req.prompt_token_ids
        dev = self.device
        slot = (self.take_slot() if self.may_take_slot(req) and (w, n, g) == dev.window_size
                else None)
        if slot is not None:  # the device slot holds the window and pool from here on
            self.admit_to(slot, lambda s: dev.admit(s, prompt, req.params.seed))
            req.spec_state = LookaheadState(w, n, g, [], None, slot=slot)
            return
        pool = NgramPool(n, g, POOL_BUCKETS)
        pool.seed_from_tokens(prompt)
        req.spec_state = LookaheadState(w, n, g, initial_window(prompt, w, n, req.params.seed),
                                        pool, fed=len(prompt),
                                        lookup=LookupIndex(*self.match, n - 1))

    def shadow_proposer(self, req: Request) -> PoolShadow:
        st: LookaheadState = req.spec_state
        return PoolShadow(st.n, st.g, req.prompt_token_ids, self.match)

    def device_plan(self, req: Request) -> DraftPlan:
        layout = step_layout(*self.device.window_size)
        return DraftPlan([req.all_token_ids[-1]] + [0] * (layout.num_tokens - 1),
                         layout.position_offsets, layout.mask,
                         device_slot=req.spec_state.slot, **self.device_sampling(req))

    def propose(self, req: Request) -> DraftPlan | None:
        st: LookaheadState = req.spec_state
        self._feed_pool(st, req.all_token_ids)
        x = req.all_token_ids[-1]
        ids = req.all_token_ids
        cands = with_lookup(st.pool.candidates(x, st.g), st.lookup.draft(ids, len(ids)),
                            st.n - 1, st.g)
        if self.full_steps:  # the step's worst case: G candidates (break-even measurement)
            cands += [(x,) * (st.n - 1)] * (st.g - len(cands))
        layout = st.layout(len(cands))
        tokens = [x] + st.window[0][1:]
        for level in st.window[1:]:
            tokens += level
        for c in cands:
            tokens += list(c)
        return DraftPlan(tokens, layout.position_offsets, layout.mask, data=(layout, cands))

    def verify(self, req: Request, logits: torch.Tensor, argmax: list[int]
               ) -> tuple[list[int], list[tuple[int, int]]]:
        """logits [T, V] of the step's rows, their argmax -> (committed tokens, KV moves
        (src row, dst off))."""
        st: LookaheadState = req.spec_state
        plan: DraftPlan = req.draft
        layout, cands = plan.data
        tokens = plan.token_ids
        window_rows, last_rows, cand_rows = layout.row_lists
        # Lookahead branch (always greedy): the last level's outputs are the new tokens.
        new = [argmax[r] for r in last_rows]
        for j in range(st.w):
            chain = [tokens[window_rows[lvl][j]] for lvl in range(len(st.window))]
            if st.n >= 2:
                st.pool.add(chain[: st.n - 1] + [new[j]])
        accepted, moves = verify_candidates(req, logits, argmax, cands, cand_rows)
        # Shift the window one position; the top level takes the new tokens.
        if len(st.window) > 1:
            st.window = [[0] + st.window[1][1:]] + st.window[2:] + [new]
        else:
            st.window = [[0] + new[1:]]
        return accepted, moves

    def on_commit(self, req: Request, num_new: int, verified: bool) -> None:
        st: LookaheadState = req.spec_state
        if st.slot is not None:  # device state: verified steps updated it already
            super().on_commit(req, num_new, verified)
        elif verified:  # plain steps' n-grams wait for the next proposal (``_feed_pool``)
            self._feed_pool(st, req.all_token_ids)

    @staticmethod
    def _feed_pool(st: LookaheadState, ids: list[int]) -> None:
        """The committed n-grams not in the host pool yet, in commit order. A request that
        decodes plainly (paced) would pay ~1-3 us per token to feed a pool it does not
        read; deferring the inserts to its next proposal or verified commit inserts the same
        n-grams in the same order after the same lookahead-branch n-grams, so the pool a
        proposal reads is the one feeding at every commit gives."""
        if st.fed < len(ids):
            st.pool.add_from(ids, st.fed, len(ids))
            st.fed = len(ids)
