"""Rank 0 drives the other ranks: what it does to its model and KV cache, it first sends.

Rank 0 runs the whole engine (scheduler, model runner, sampler, speculative workers); its
model and KV cache are wrapped (``LeaderModel``, ``LeaderCache``) so that each forward's
inputs and each KV move go to the other ranks before rank 0 runs them itself. A follower
(``follow``) runs what it receives on its own shard and cache. What is sent is the model's
input, not the scheduler's batch: the runner builds it once, on rank 0, and the followers
need no request state. Every rank's cache takes the same writes at the same slots, so block
tables, the prefix cache and preemption stay rank 0's business.

The commands are pickled over the gloo control group (``broadcast_object_list``: two
broadcasts, the size then the bytes; a gloo send returns once every follower has taken
it), their tensors on the host. Measured on a 2-core CPU machine, smollm2-135m tp 3,
batch 8 decode: 2.9 ms median per step against a 340 ms forward.

A staged step (the Triton path, kiln/runtime/staging.py; every step of a CUDA engine) sends
less: ``StagedStep`` carries only the step's sizes and which CUDA graph it replays, as a
few integers (``TPGroup.send_words``, not pickled); the
staged input buffers follow on the model group (one NCCL broadcast of rank 0's device
buffer, after any on-device patch of its token ids), and every rank replays the same graph
(``ModelRunner.forward_staged``), whose collectives pair up inside.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kiln.runtime.cuda_graph import Bucket
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import AttentionMetadata
from kiln.runtime.memory import peak_memory
from kiln.runtime.parallel.group import TPGroup
from kiln.runtime.staging import Staged


@dataclass(frozen=True)
class Forward:
    """``LlamaModel.forward``'s inputs (its cache is each rank's own); ``entries``: the
    step's device speculation plans (kiln.runtime.speculative.verify.SpecEntries),
    whose proposal and verification every rank runs around the forward, or None."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor
    entries: Any = None

    def run(self, runner: Any) -> None:
        model, cache, spec = runner.model, runner.cache, runner.spec_step
        f = moved(self, cache.k.device)
        # the ids hold rank 0's proposal already; this rank's (the same) gives the epilogue
        # its proposal
        proposal = spec.prologue(f.entries, f.input_ids) if f.entries is not None else None
        logits = model.forward(f.input_ids, f.positions, cache, f.meta, f.logit_rows)
        if f.entries is not None:
            spec.epilogue(f.entries, proposal, logits, f.meta.slot_mapping, cache)


@dataclass(frozen=True)
class StagedStep:
    """A staged step: its sizes (``Staged``) and the graph bucket it replays (None: an
    eager forward); rank 0's staged buffers follow on the model group."""

    bucket: Any
    staged: Any
    num_entries: int = 0  # device speculation plans staged (their steps run on every rank)

    KIND = 1  # its first word (``TPGroup.send_words``)

    def words(self) -> list[int]:
        st, b = self.staged, self.bucket
        out = [self.KIND, st.num_seqs, st.num_tokens, st.num_rows, st.max_query_len,
               st.max_context_len, int(st.masked), st.mask_bytes, self.num_entries]
        out += ([1, b.num_seqs, b.num_tokens, int(b.masked), b.max_query_len, b.num_rows]
                if b is not None else [0] * 6)
        return out + [st.single_rows]

    @classmethod
    def from_words(cls, w: list[int]) -> StagedStep:
        staged = Staged(w[1], w[2], w[3], w[4], w[5], bool(w[6]), w[7], w[15])
        bucket = Bucket(w[10], w[11], bool(w[12]), w[13], w[14]) if w[9] else None
        return cls(bucket, staged, w[8])

    def receive(self, group: TPGroup, stager: Any) -> None:
        """Rank 0's staged buffers into this rank's (``LeaderModel.send_staged``)."""
        group.broadcast(stager.dev)
        if self.staged.mask_bytes:
            group.broadcast(stager.mask_dev[: self.staged.mask_bytes])


@dataclass(frozen=True)
class MoveSlots:
    """``KVCache.move_slots`` (a speculative step keeps its accepted tokens' KV)."""

    src: torch.Tensor
    dst: torch.Tensor

    def run(self, runner: Any) -> None:
        cache = runner.cache
        cache.move_slots(self.src.to(cache.k.device), self.dst.to(cache.k.device))


@dataclass(frozen=True)
class StateCall:
    """A host write into the device speculation state (``LeaderState``): every rank holds
    the same state and runs the same proposal and verification inside its steps."""

    method: str
    args: tuple

    def run(self, runner: Any) -> None:
        state = runner.spec_step.proposer
        getattr(state, self.method)(*moved(self.args, state.device))


@dataclass(frozen=True)
class ReportMemory:
    """Every rank's peak memory (kiln.runtime.memory), gathered on rank 0 (``Ranks.memory``)."""


@dataclass(frozen=True)
class Stop:
    """The engine is closing: the follower leaves its loop."""


class LeaderModel:
    """Rank 0's model: ``forward`` sends its inputs to the other ranks, then runs (the
    ranks' collectives pair up inside). Everything else is the wrapped model's."""

    def __init__(self, model: Any, group: TPGroup, on_error: Any):
        self.model, self.group, self._on_error = model, group, on_error

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any,
                meta: AttentionMetadata, logit_rows: torch.Tensor,
                entries: Any = None) -> torch.Tensor:
        """``entries``: the device speculation plans of an eager step
        (``ModelRunner.execute``), which the other ranks verify too."""
        try:
            self.group.send(moved(Forward(input_ids, positions, meta, logit_rows, entries),
                                  "cpu"))
            return self.model.forward(input_ids, positions, cache, meta, logit_rows)
        except Exception as e:  # the ranks may be out of step now: the engine is done
            raise self._on_error(e) from e

    def send_staged(self, bucket: Any, staged: Any, stager: Any, num_entries: int = 0) -> None:
        """Before the staged step's forward (``ModelRunner._execute_staged``): its sizes,
        bucket and device plans, then the staged buffers, to the other ranks."""
        try:
            step = StagedStep(bucket, staged, num_entries)
            self.group.send_words(step.words())
            step.receive(self.group, stager)  # rank 0 sends
        except Exception as e:
            raise self._on_error(e) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class LeaderCache:
    """Rank 0's KV cache: ``move_slots`` is sent to the other ranks first. Everything else
    (the tensors the attention backend reads and writes) is the wrapped cache's."""

    def __init__(self, cache: KVCache, group: TPGroup, on_error: Any):
        self.cache, self.group, self._on_error = cache, group, on_error

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        try:
            self.group.send(MoveSlots(src.cpu(), dst.cpu()))
        except Exception as e:
            raise self._on_error(e) from e
        self.cache.move_slots(src, dst)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


class LeaderState:
    """Rank 0's device proposer (kiln.runtime.speculative.device_step.DeviceProposer): the
    host's writes into it (``admit`` a request, ``fold`` what plain steps committed,
    ``release`` a slot) run here, then on every other rank's copy. The steps' proposal, verification and KV moves need nothing
    sent: every rank runs them on the same staged entries and the same all-gathered logits,
    so the copies stay equal. Everything else is the wrapped state's."""

    def __init__(self, state: Any, group: TPGroup, on_error: Any):
        self.state, self.group, self._on_error = state, group, on_error

    def admit(self, *args) -> None:
        self._call("admit", args)

    def fold(self, *args) -> None:
        self._call("fold", args)

    def release(self, *args) -> None:
        self._call("release", args)

    def _call(self, method: str, args: tuple) -> None:
        getattr(self.state, method)(*args)  # raises here first on a bad request
        try:
            self.group.send(StateCall(method, moved(args, "cpu")))
        except Exception as e:
            raise self._on_error(e) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self.state, name)


def follow(runner: Any, group: TPGroup) -> None:
    """A follower's loop: run rank 0's commands on ``runner`` (its ModelRunner: model,
    cache, stager, device speculation step) until ``Stop``."""
    while True:
        command = group.recv()
        if isinstance(command, Stop):
            return
        if isinstance(command, ReportMemory):
            group.gather_object(peak_memory(runner.cache.k.device))
        elif isinstance(command, list) and command[0] == StagedStep.KIND:
            step = StagedStep.from_words(command)
            step.receive(group, runner.stager)
            runner.forward_staged(step.bucket, step.staged, step.num_entries)
        elif isinstance(command, (Forward, MoveSlots, StateCall)):
            command.run(runner)
        else:
            raise TypeError(f"unknown command {type(command).__name__} from rank 0")


def moved(obj: Any, device: Any) -> Any:
    """``obj`` with every tensor in it (dataclass fields, lists, tuples) on ``device``:
    commands travel with host tensors, each rank runs them on its own device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(moved(x, device) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: moved(getattr(obj, f.name), device)
                                          for f in dataclasses.fields(obj) if f.init})
    return obj
