"""A speculative step of device-state requests around the model's forward, whatever the mode.

The model runner runs it, not the worker (the engine drives the forward, a worker only
proposes and verifies). A mode's device side is a ``DeviceProposer`` (lookahead: a tree
step, accepted rows' KV moved; prompt lookup: a chain, nothing moved; a draft model: chains
whose drafts ``DraftModelWorker.fill`` wrote into the input rows); ``DeviceSpecStep`` runs
every one the same way, for a step whose batch holds plans of its slots
(``DraftPlan.device_slot``):

    proposal = step.prologue(entries, input_ids)      # before the forward: the plans'
                                                      # tokens into the step's input ids
    logits = model.forward(...)
    out = step.epilogue(entries, proposal, logits, slot_mapping, cache)
                                                      # targets, verify, state update, KV move

``entries`` has one row per possible plan: the slot (-1: none), the input row of the plan's
x (``q0``), the logits row of x (``r0``; a plan's T rows follow in order) and how the plan
is verified (``inv_temp`` 0: greedy; else sampled at that inverse temperature with the
plan's Philox ``key``, among the tokens its top-k / top-p / min-p keep, ``warp``; see
``verify.row_targets``). A CUDA graph
of a masked bucket captures both around its forward with one entry per sequence of the
bucket (kiln/runtime/cuda_graph.py); the entries then live in the stager's buffers, so the
same graph serves any mix of device plans, host plans and plain rows.

Verification compares each draft token with the row's *target*: the argmax for greedy
plans, a draw from the row's distribution for sampled ones (``verify.row_targets``). Accepting the
longest prefix of drafts that equal their targets, then the target after it, is exact
in distribution for a sampled request: a draft token d is accepted with probability p(d),
and on rejection the committed token is distributed as p without d, renormalised (the
rejection rule for a one-token draft; ``verify.verify_position`` is the host's form of it). The
rows of one plan at the same depth (lookahead candidates sharing a prefix) draw with the
same noise, so they agree on the token there as one draw would.

On CUDA a proposer's steps are kernels of fixed shape (kiln/runtime/kernels/lookahead.py,
ngram.py, sampling.py): no host sync, capturable. Elsewhere the same steps run as the
state's torch ops on the entries that hold a slot (the reference the kernels are tested
against); each proposer chooses once, at construction. What a step commits comes back as
``SpecOutput`` (device tensors); the worker reads it with one host copy.

The state is advanced in place when the step runs. A step that fails after that fails its
requests (LLMEngine.step: every request of a failed step fails, and its slot is released),
so no request goes on with a state its tokens do not match.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative.verify import SpecEntries, step_targets


@dataclass
class StagedRows:
    """The step's staged device inputs a shifted plan rewrites (int32): ``positions`` and
    ``slots`` [num_tokens], ``context_lens`` [num_seqs], ``block_tables`` [num_seqs, M]."""

    positions: torch.Tensor
    slots: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int


@dataclass
class SpecOutput:
    """What a step committed per entry: ``committed`` [B, N] (accepted drafts, then the bonus
    token) and ``count`` [B] (tokens committed; 0 for entries without a plan)."""

    committed: torch.Tensor
    count: torch.Tensor

    def packed(self) -> torch.Tensor:
        """[B, N + 1]: each entry's committed tokens, then their count (one host copy)."""
        return torch.cat([self.committed, self.count[:, None]], 1)


@dataclass
class Proposal:
    """What ``DeviceProposer.propose_step`` proposed, for its ``commit_step``."""

    tokens: torch.Tensor  # [B, T] (rows of entries without a plan: unset)
    valid: torch.Tensor | None  # lookahead: [B, G] real candidates; prompt lookup: [B]
    # draft lengths; a draft model: None (its drafts are all real)
    active: torch.Tensor | None = None  # torch path: indices of the entries with a slot


class DeviceProposer(ABC):
    """One speculative mode on the device: its per-slot state, its proposal and the commit
    of what verification accepted. ``DeviceSpecStep`` runs every proposer the same way and
    never asks which mode it is; the engine makes one at start-up
    (``workers.make_device_state``, from the mode recorded at build: ``workers.MODES``).

    Attributes every proposer has: ``num_slots`` (S: requests whose state it holds, and
    the most entries of a step), ``num_tokens`` (T: input rows of one plan), ``commit_width``
    (the most tokens a step commits), ``verify_offsets`` [T] (each row's depth in its plan
    where it verifies, -1 where it does not: ``verify.row_targets``), ``last_count`` [S] (what the
    last step committed per entry row, for a step launched ahead) and ``kernels`` (the Triton
    kernels, else the torch ops they are tested against; chosen at construction: CUDA).

    Host side, once per request (outside the step; a tensor-parallel engine replays these
    on every rank): ``admit`` a request's prompt into a free slot, ``fold`` the tokens its
    plain steps committed, ``release`` the slot. Device side, inside the step (and its CUDA
    graph; fixed shapes, no host sync): ``propose_step`` writes every plan's T tokens into the
    step's input rows, ``commit_step`` takes the rows' target tokens and commits what they
    accept, updating the state in place."""

    name: ClassVar[str]  # the speculative mode (``SpeculativeConfig.mode``)
    default_on: ClassVar[bool] = False  # its state on the device unless the runtime says

    def __init__(self, num_slots: int, num_tokens: int, commit_width: int,
                 verify_offsets: torch.Tensor, device: torch.device):
        self.num_slots = num_slots
        self.num_tokens = num_tokens
        self.commit_width = commit_width
        self.device = torch.device(device)
        self.verify_offsets = verify_offsets.to(self.device)
        self.last_count = torch.ones(num_slots, dtype=torch.long, device=self.device)
        self.use_kernels(self.device.type == "cuda")

    @classmethod
    @abstractmethod
    def from_config(cls, spec: SpeculativeConfig, num_slots: int, max_seq_len: int,
                    device: torch.device) -> DeviceProposer | None:
        """The proposer of an engine built with ``spec`` (its mode is ``cls.name``) for
        ``num_slots`` requests of up to ``max_seq_len`` tokens, or None where this mode's
        setting keeps its state on the host."""

    def use_kernels(self, on: bool) -> None:
        """Run the steps (and ``fold``) through the Triton kernels, else the torch ops.
        Chosen at construction; tests call it to run the kernels on the CPU (interpreted)."""
        self.kernels = on

    def admit(self, slot: int, prompt: list[int], seed: int | None) -> None:
        """Load a request's initial state into ``slot`` from its ``prompt`` (``seed``: its
        sampling seed). A proposer without per-slot state loads nothing."""

    def fold(self, slots: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> None:
        """``tokens[b, :count[b]]`` ([B, K] long), committed by plain steps of the requests
        in ``slots`` [B], join their state."""

    def release(self, slot: int) -> None:
        """The request in ``slot`` left the engine (the next ``admit`` overwrites it)."""

    def warm(self) -> None:
        """Compile what the proposer runs outside the step's CUDA graph (engine start-up)."""

    @abstractmethod
    def propose_step(self, entries: SpecEntries, input_ids: torch.Tensor) -> Proposal:
        """Each plan's T tokens, from its slot, written at ``input_ids[q0 : q0 + T]``."""

    @abstractmethod
    def commit_step(self, entries: SpecEntries, proposal: Proposal, targets: torch.Tensor,
                    slot_mapping: torch.Tensor, cache: KVCache
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify each plan against ``targets`` [B, T] (every row's target token,
        ``verify.step_targets``), fold what it accepted into the state and keep only the accepted
        rows' KV (``slot_mapping``: the cache slot of every input row). Returns (committed
        [B, commit_width]: accepted drafts then the bonus token, count [B]: 0 for entries
        without a plan)."""

    # -- the torch path's shared steps ------------------------------------------------------
    def _propose_active(self, entries: SpecEntries, input_ids: torch.Tensor,
                        propose: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                        ) -> Proposal:
        """``propose(slots)`` (the state's torch ops) for the entries that hold a slot,
        their tokens written into their input rows."""
        active = torch.nonzero(entries.slots >= 0)[:, 0]
        tokens, valid = propose(entries.slots[active])
        rows = entries.q0[active, None] + torch.arange(self.num_tokens, device=self.device)
        input_ids[rows.reshape(-1)] = tokens.reshape(-1).to(input_ids.dtype)
        return Proposal(tokens, valid, active)

    def _scatter(self, entries: SpecEntries, active: torch.Tensor, committed: torch.Tensor,
                 count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The active entries' verdict as every entry's (count 0 where no plan)."""
        b = entries.slots.shape[0]
        out = torch.zeros(b, self.commit_width, dtype=torch.long, device=self.device)
        counts = torch.zeros(b, dtype=torch.long, device=self.device)
        out[active], counts[active] = committed, count
        return out, counts


class DeviceSpecStep:
    """Proposal before and verification after one forward, for the slots of one
    ``DeviceProposer``; the same for every mode."""

    def __init__(self, proposer: DeviceProposer):
        self.proposer = proposer

    @property
    def last_count(self) -> torch.Tensor:
        """[S] what the last step committed per entry row (its count)."""
        return self.proposer.last_count

    def prologue(self, entries: SpecEntries, input_ids: torch.Tensor,
                 staged: StagedRows | None = None) -> Proposal:
        """Propose each entry's step from its slot; write its T tokens at
        ``input_ids[q0 : q0 + T]``. With ``staged``, plans staged ahead (``entries.shift``)
        first move on by the last step's extra committed tokens."""
        p = self.proposer
        if staged is not None and entries.shift is not None:
            shift_rows(entries, staged, p.last_count, p.num_tokens, p.kernels)
        return p.propose_step(entries, input_ids)

    def epilogue(self, entries: SpecEntries, proposal: Proposal, logits: torch.Tensor,
                 slot_mapping: torch.Tensor, cache: KVCache) -> SpecOutput:
        """Verification of each entry's step from ``logits`` (its T rows from ``r0``;
        greedy or sampled, ``verify.row_targets``), the state update, and the KV move of the
        accepted rows (``slot_mapping``: the cache slot of every input row)."""
        p = self.proposer
        targets = step_targets(logits, entries, p.verify_offsets, p.num_tokens, p.kernels)
        committed, count = p.commit_step(entries, proposal, targets, slot_mapping, cache)
        p.last_count[: count.shape[0]].copy_(count)
        return SpecOutput(committed, count)


def shift_rows(entries: SpecEntries, staged: StagedRows, last_count: torch.Tensor, t: int,
               kernels: bool) -> None:
    """Plans staged as if the step before committed one token: their positions, cache
    slots and context length move on by what it committed beyond one (``last_count[e] -
    1`` for entry row e). Row r of a plan (``t`` rows from ``q0``) writes its KV at token
    index x + r (x: its row 0's position), whatever its position (a tree's rows share
    positions), so its new slot is that index's, moved on, in the staged block table."""
    if kernels:
        from kiln.runtime.kernels.lookahead import shift_staged_rows

        shift_staged_rows(entries.shift, entries.slots, entries.seq, entries.q0, last_count,
                          staged.positions, staged.slots, staged.context_lens,
                          staged.block_tables, staged.block_size, t)
        return
    delta = torch.where((entries.shift > 0) & (entries.slots >= 0),
                        last_count[: entries.shift.shape[0]] - 1, 0)
    live = torch.nonzero(delta)[:, 0]
    if not live.numel():
        return
    k = torch.arange(t, device=delta.device)
    rows = (entries.q0[live, None] + k).reshape(-1)
    d = delta[live].repeat_interleave(t)
    seq = entries.seq[live]
    idx = (staged.positions[entries.q0[live]].long()[:, None] + k).reshape(-1) + d
    pos = staged.positions[rows].long() + d
    bs = staged.block_size
    blocks = staged.block_tables[seq.repeat_interleave(t), idx // bs].long()
    staged.positions[rows] = pos.to(staged.positions.dtype)
    staged.slots[rows] = (blocks * bs + idx % bs).to(staged.slots.dtype)
    staged.context_lens[seq] += delta[live].to(staged.context_lens.dtype)


def device_verifiable(params: SamplingParams) -> bool:
    """Whether a request's speculative steps can be verified on the device: greedy, or
    sampled (temperature, with or without top-k, top-p and min-p: the sampling kernels
    find a warped row's threshold, ``plan_thresholds``). Requests that speculate at all
    (``workers.request_window``) need no other host processing."""
    return params.greedy or params.temperature > 0


def plan_warp(params: SamplingParams) -> tuple[float, float, float]:
    """A sampled plan's ``SpecEntries.warp`` row: (top_k (0: off), top_p, min_p)."""
    return (float(max(0, params.top_k)), float(params.top_p),
            float(params.min_p))
