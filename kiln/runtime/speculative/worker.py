"""Draft-and-verify workers over the engine's one model (lookahead, ngram).

The engine runs the forward of a batch that holds draft steps; ``DraftWorker.step(batch,
result, cache, on_error)`` (final, from ``SpeculativeWorker``) verifies each draft in the
forward's ``result``, moves accepted KV into place and sets the tokens each request
commits. Draft plans are per-step state: they are cleared whatever happens, so a step that
raises (a bug in verification) leaves every request exactly as it was before the step:
``num_computed_tokens`` unchanged, KV beyond it unused, and the next step recomputes.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kiln.runtime.host_copy import to_device
from kiln.runtime.kv_cache import KVCache, slot_of
from kiln.runtime.request import Request
from kiln.runtime.scheduler import ScheduledBatch
from kiln.runtime.speculative.base import SpeculativeWorker
from kiln.runtime.speculative.device_step import DeviceProposer, device_verifiable, plan_warp
from kiln.runtime.speculative.draft import DraftPlan, DraftTree
from kiln.runtime.speculative.pace import BreakEven, DraftPace, Shadow, SpecPace
from kiln.runtime.speculative.verify import walk_tree
from kiln.runtime.step import StepResult

if TYPE_CHECKING:
    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.runtime.speculative.draft_model import DraftModel

OnError = Callable[[Request, str, BaseException], None]


class DraftWorker(SpeculativeWorker):
    """Base of the one-model workers; subclasses propose and verify, the base runs steps."""

    name = "draft"

    def __init__(self, device: DeviceProposer | None = None) -> None:
        super().__init__()
        self.full_steps = False  # pad every host proposal to the step's worst case (full T:
        # the break-even measurement, speculative/break_even.py)
        # the engine's device proposer (its slots), or None: requests that take a slot keep
        # their state there (``req.spec_state.slot``) and their plans are proposed and
        # verified on the device (``DeviceSpecStep``)
        self.device = device
        self._free_slots = list(range(device.num_slots))[::-1] if device is not None else []

    @classmethod
    @abstractmethod
    def from_config(cls, spec: SpeculativeConfig, device: DeviceProposer | None,
                    draft: DraftModel | None) -> DraftWorker:
        """The worker of an engine built with ``spec`` (its mode is ``cls.name``);
        ``device``: the mode's proposer (None: every request on the host); ``draft``: a
        draft-model engine's draft model."""

    @abstractmethod
    def init_request(self, req: Request, window: tuple[int, int, int]) -> None:
        """Create ``req.spec_state`` for a request that speculates."""

    @abstractmethod
    def propose(self, req: Request) -> DraftPlan | None:
        """The next step's plan for a request whose only uncomputed token is its last."""

    @abstractmethod
    def verify(self, req: Request, logits: torch.Tensor, argmax: list[int]
               ) -> tuple[list[int], list[tuple[int, int]]]:
        """logits [T, V] of the plan's rows (``argmax``: their argmax, already on the host)
        -> (committed tokens, KV moves).

        A move (row, k) says: the KV written by in-step row ``row`` belongs at offset ``k``
        from x's index (the accepted draft's final position).
        """

    @abstractmethod
    def shadow_proposer(self, req: Request):
        """What the request's shadow (``pace.Shadow``) proposes with: the worker's
        proposal from committed text alone (a ``pace.ShadowProposer``)."""

    def fill(self, batch: ScheduledBatch, on_error: OnError
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Called once the step is scheduled, before its forward: complete the plans it runs
        (a draft model draws its drafts here, once the step's KV blocks are allocated).
        Returns token ids drawn on the device for the step's input rows (rows [k], ids
        [k]; ``ModelRunner.execute``'s ``scatter``), or None."""
        return None

    def pace(self, req: Request, break_even: BreakEven) -> SpecPace | DraftPace | None:
        """The request's pacing at ``break_even``: a ``SpecPace`` over the worker's shadow
        proposer."""
        proposer = self.shadow_proposer(req)
        return SpecPace(Shadow(proposer, req.num_prompt_tokens), break_even,
                        gain=proposer.prior_gain)

    def device_plan(self, req: Request) -> DraftPlan:
        """The plan of a request whose state is in a device slot: x and placeholders (the
        step's tokens are proposed on the device), its slot named."""
        raise NotImplementedError(f"{type(self).__name__} proposes no plans on the device")

    @staticmethod
    def device_sampling(req: Request) -> dict:
        """How the device verifies ``req``'s next plan (``DraftPlan.inv_temp`` / ``key`` /
        ``warp``): greedy, or sampled at its temperature, top-k, top-p and min-p with a
        fresh Philox key (from the request's own generator when it is seeded, so its draws
        do not depend on the batch)."""
        p = req.params
        if p.greedy:
            return {}
        key = int(torch.randint(0, 2**31 - 1, (), generator=req.generator))
        return {"inv_temp": 1.0 / p.temperature, "key": key, "warp": plan_warp(p)}

    def after_forward(self, fwd) -> None:
        """Called after a step's forward whose plans ran on the device (``fwd.spec``), before
        what they committed is read: the worker may replace a plan's verdict."""

    def chainable(self, req: Request) -> bool:
        """Whether the device step after the one in flight may launch ahead for ``req``
        (its device state holds what that needs)."""
        return True

    def may_take_slot(self, req: Request) -> bool:
        """Whether ``req`` may keep its state in a device slot: the worker has slots, and
        the device can verify its steps (greedy or sampled, no grammar)."""
        return (self.device is not None and req.matcher is None
                and device_verifiable(req.params))

    def on_commit(self, req: Request, num_new: int, verified: bool) -> None:
        """Called after ``num_new`` tokens were committed to ``req`` (``verified``: by a
        verified speculative step). A device slot holds what its verified steps committed;
        what plain steps commit waits on the host until the slot's next proposal."""
        st = req.spec_state
        if getattr(st, "slot", None) is not None and not verified:
            ids = req.all_token_ids
            st.pending += ids[len(ids) - num_new:]

    def take_slot(self) -> int | None:
        """A free device slot for a request that is admitted to one, or None."""
        return self._free_slots.pop() if self._free_slots else None

    def admit_to(self, slot: int, admit: Callable[[int], None]) -> None:
        """Load a request's state into ``slot`` (``admit(slot)``); if that raises, the slot
        is free again and the error goes on."""
        try:
            admit(slot)
        except BaseException:
            self._free_slots.append(slot)
            raise

    def release(self, req: Request) -> None:
        """``req`` finished or left the engine: free what the worker holds for it (its
        device slot)."""
        st = req.spec_state
        if getattr(st, "slot", None) is not None:
            self.device.release(st.slot)
            self._free_slots.append(st.slot)
            st.slot = None

    def propose_batch(self, reqs: list[Request], on_error: OnError) -> None:
        """Set ``req.draft`` for each request (all may speculate now); a proposal that
        raises goes to ``on_error`` and the rest go on. Requests in device slots get plans
        that name their slot (the model runner proposes and verifies them around the
        step's forward); the tokens their plain steps committed are folded into the slots
        first."""
        on_dev = []
        for req in reqs:
            if on_device(req):
                on_dev.append(req)
                continue
            try:
                req.draft = self.propose(req)
            except Exception as e:
                req.draft = None
                on_error(req, "speculative proposal", e)
        if not on_dev:
            return
        try:
            self._fold_pending([r for r in on_dev if r.spec_state.pending])
            for req in on_dev:
                req.draft = self.device_plan(req)
        except Exception as e:
            for req in on_dev:
                req.draft = None
                on_error(req, "speculative proposal", e)

    def _fold_pending(self, reqs: list[Request]) -> None:
        """Tokens committed by plain steps into the requests' device slots (one batched
        update: ``fold`` of the slots' state)."""
        if not reqs:
            return
        dev = self.device
        slots = to_device([r.spec_state.slot for r in reqs], torch.long, dev.device)
        pending = [r.spec_state.pending for r in reqs]
        width = max(len(p) for p in pending)
        toks = to_device([t for p in pending for t in p + [0] * (width - len(p))], torch.long,
                         dev.device).view(len(reqs), width)
        dev.fold(slots, toks, to_device([len(p) for p in pending], torch.long, dev.device))
        for r in reqs:
            r.spec_state.pending = []

    def verify_on_device(self, reqs: list[Request], result: StepResult, cache: KVCache,
                         on_error: OnError) -> None:
        """The device plans were verified in the step (``result.spec``): read what each
        committed, one host copy for the batch."""
        host = result.spec.packed().tolist()
        for req in reqs:
            row = host[result.spec_entries[req]]
            result.add_verified(req, row[: row[-1]])

    # -- the step ----------------------------------------------------------------------------
    def propose_all(self, reqs: list[Request], on_error: OnError) -> None:
        """Plan the next step of every request that may speculate now; a proposal that
        raises goes to ``on_error`` (the engine fails that request) and the rest go on.
        Once one request of a device slot speculates, every request of a device slot
        rides along: the step's masked bucket pads each sequence to a full step, so their
        drafts cost no more forward, and requests of the host state decode plainly beside
        them (a host plan would make the step synchronous for the whole batch; plain rows
        the device samples keep it launched ahead)."""
        ready = [r for r in reqs if r.spec_state is not None
                 and r.num_computed_tokens == r.num_tokens - 1]
        chosen = [r for r in ready if r.spec_pace is None or r.spec_pace.active]
        if any(on_device(r) for r in chosen):
            chosen = [r for r in ready if on_device(r)]
        self.propose_batch(chosen, on_error)

    def after_commit(self, req: Request, num_new: int, verified: bool) -> None:
        """The worker's state and pacing after ``req`` committed ``num_new`` tokens
        (``verified``: in a verified speculative step)."""
        if req.spec_state is None:
            return
        self.on_commit(req, num_new, verified)
        if req.spec_pace is not None:
            if verified:
                req.spec_pace.on_spec_step(num_new, req.all_token_ids)
            elif num_new:
                req.spec_pace.on_plain_step(req.all_token_ids)

    def _save_state(self, batch: ScheduledBatch, *args) -> None:
        planned = [r for r, _ in batch.items if r.draft is not None]

        def clear_plans() -> None:
            for r in planned:
                r.draft = None

        self.saved.push("draft plans", clear_plans)

    def _step_impl(self, batch: ScheduledBatch, result: StepResult, cache: KVCache,
                   on_error: OnError) -> StepResult:
        on_device = [r for r in result.spec_entries if not r.is_finished]
        if on_device:
            try:
                self.verify_on_device(on_device, result, cache, on_error)
            except Exception as e:
                for req in on_device:
                    on_error(req, "speculative verification", e)
                    result.tokens.pop(req, None)
        drafts = result.draft_logits  # host plans
        # Every draft row's argmax in one host copy (one sync per step, not per request).
        flat = torch.cat([lg.argmax(-1) for lg in drafts.values()]).tolist() if drafts else []
        bs = cache.block_size
        src: list[int] = []
        dst: list[int] = []
        off = 0
        for req, logits in drafts.items():
            argmax = flat[off : off + logits.shape[0]]
            off += logits.shape[0]
            try:
                accepted, moves = self.verify(req, logits, argmax)
            except Exception as e:
                on_error(req, "speculative verification", e)
                result.tokens.pop(req, None)
                continue
            base = req.num_computed_tokens  # x's token index
            table = req.block_table
            for r, k in moves:
                src.append(slot_of(table, base + r, bs))
                dst.append(slot_of(table, base + k, bs))
            result.add_verified(req, accepted)  # the engine counts what it commits
        if src:  # one move for the whole step: requests own disjoint blocks past their prefix
            dev = cache.k.device
            cache.move_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        return result


class TreeWorker(DraftWorker):
    """A worker whose plan is a token tree of drafts after x (``DraftTree``; a chain for
    prompt lookup), from the request's own state (``req.spec_state.draft(ids, n)``: prompt
    lookup's chain, suffix decoding's tree), verified in one step by ``walk_tree``."""

    trees = False  # whether its plans may branch (then the worst case is a masked step)

    def __init__(self, max_draft_len: int, device: DeviceProposer | None = None) -> None:
        super().__init__(device)
        self.max_draft_len = max_draft_len

    def propose(self, req: Request) -> DraftPlan | None:
        ids = req.all_token_ids
        tree = req.spec_state.draft(ids, len(ids))
        if not isinstance(tree, DraftTree):
            tree = DraftTree.chain(tree)
        x = ids[-1]
        if self.full_steps:  # the step's worst case: max_draft_len drafts (break-even)
            tree = tree.padded(self.max_draft_len, x, branch=self.trees)
        if not tree.tokens:
            return None
        offsets, mask = tree.layout()
        return DraftPlan([x] + tree.tokens, offsets, mask, data=tree)

    def verify(self, req: Request, logits: torch.Tensor, argmax: list[int]
               ) -> tuple[list[int], list[tuple[int, int]]]:
        accepted, moves, _ = walk_tree(req, logits, argmax, req.draft.data.children())
        return accepted, moves


def on_device(req: Request) -> bool:
    """Whether ``req``'s speculative state is in a device slot (its plans run there)."""
    return getattr(req.spec_state, "slot", None) is not None
