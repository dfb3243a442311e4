"""What the engine's step asks of speculative decoding, behind one object chosen at start-up.

``LLMEngine`` runs every step as schedule -> launch -> collect and never asks which mode
runs: it calls a ``StepProposer`` at fixed points (a request joins or leaves, the batch is
scheduled, the forward ran, tokens were committed, the step after a launched one). The
base class proposes nothing: its steps are plain steps. ``SpeculativeProposer`` drives the
engine's ``DraftWorker`` (plans proposed on the host or in device slots, verified on the
host inside the worker's exception-safe ``step`` or on the device inside the forward) and
chains device speculative steps launched ahead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import ScheduledBatch, Scheduler
from kiln.runtime.speculative.break_even import spec_break_even
from kiln.runtime.speculative.device_step import DeviceProposer
from kiln.runtime.speculative.draft_model import DraftModel
from kiln.runtime.speculative.pace import BreakEven, gate_batch
from kiln.runtime.speculative.worker import DraftWorker, OnError, on_device
from kiln.runtime.speculative.workers import make_worker, request_window
from kiln.runtime.step import LaunchedStep, StepResult

DeviceSamples = Callable[[list[Request]], bool]  # whether the device alone samples these


class StepProposer:
    """The engine's proposer of a plain engine: it proposes nothing, so every step is a
    plain step (each request reads back one token). Requests are still validated against
    the engine's speculative setting (``request_window``: a window it has not is a 400)."""

    worker: DraftWorker | None = None
    break_even: BreakEven | None = None  # pacing: what a speculative step must commit
    admits_ahead = True  # prompt chunks and admissions may join a step launched ahead

    def __init__(self, spec: SpeculativeConfig):
        self.spec = spec

    def start(self, engine) -> None:
        """Once the engine can run steps, at start-up (``LLMEngine``: its ``startup_times``)."""

    def add_request(self, req: Request, params: SamplingParams) -> None:
        """A request joins the engine (its speculative state and pacing, if it speculates)."""
        request_window(self.spec, params)

    def propose(self, running: list[Request], on_error: OnError) -> None:
        """Before the scheduler runs: plan the next step of the requests that speculate now
        (``req.draft``)."""

    def fill(self, batch: ScheduledBatch, on_error: OnError
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The scheduled step's token ids drawn on the device for its input rows, or None
        (``ModelRunner.execute``'s ``scatter``)."""
        return None

    def launchable(self, batch: ScheduledBatch, device_samples: DeviceSamples) -> bool:
        """Whether the step's tokens can be chosen on the device alone."""
        return device_samples([r for r, _ in batch.items])

    def after_forward(self, fwd) -> None:
        """Right after the step's forward, before anything reads its logits."""

    def verdict(self, fwd, batch: ScheduledBatch) -> torch.Tensor | None:
        """A launched step's plans verified on the device: [B, N + 1] commits and their
        count per entry (``fwd.spec_entries``), to copy back with its samples; None: none."""
        return None

    def verify(self, batch: ScheduledBatch, fwd, result: StepResult, cache: KVCache,
               on_error: OnError) -> bool:
        """A step sampled on the host: verify its plans into ``result``; whether any ran."""
        return False

    def may_speculate(self, reqs: list[Request]) -> bool:
        """Whether the step after the one in flight may speculate for one of ``reqs`` (then
        it cannot be launched ahead: its draft needs the in-flight token)."""
        return False

    def schedule_chain(self, cur: LaunchedStep, on_error: OnError
                       ) -> tuple[ScheduledBatch | None, tuple | None]:
        """The device speculative step after ``cur`` (a launched step with device plans) and
        its ``fill``, scheduled before ``cur``'s commits are read; (None, None) when the
        chain stops and the plain scheduler runs after ``cur``."""
        return None, None

    def after_commit(self, req: Request, num_new: int, verified: bool) -> None:
        """``req`` committed ``num_new`` tokens (``verified``: in a verified speculative step)."""

    def release(self, req: Request) -> None:
        """``req`` left the engine: free its speculative state."""


class SpeculativeProposer(StepProposer):
    """The engine's proposer of a speculative engine, over its ``DraftWorker``."""

    admits_ahead = False  # a request joining ahead may speculate: its draft needs the host

    def __init__(self, spec: SpeculativeConfig, worker: DraftWorker, scheduler: Scheduler,
                 runner, device_samples: DeviceSamples, max_seq_len: int):
        super().__init__(spec)
        self.worker = worker
        self.scheduler = scheduler
        self.runner = runner  # its ``spec_step``: the device proposal and verification
        self.device_samples = device_samples
        self.max_seq_len = max_seq_len
        # the most a device speculative step commits per request (0: none on the device)
        self.width = worker.device.commit_width if worker.device is not None else 0

    def start(self, engine) -> None:
        """The break-even of pacing (``break_even.spec_break_even``), measured on CUDA by
        running the engine's steps."""
        t0 = time.perf_counter()
        self.break_even = spec_break_even(engine)
        engine.startup_times["spec_break_even_s"] = time.perf_counter() - t0
        engine.startup_times["total_s"] += engine.startup_times["spec_break_even_s"]

    def add_request(self, req: Request, params: SamplingParams) -> None:
        window = request_window(self.spec, params)
        if window is not None:
            self.worker.init_request(req, window)
            if self.break_even is not None and params.seed is None:
                req.spec_pace = self.worker.pace(req, self.break_even)

    def gate(self, running: list[Request]) -> None:
        """Pacing at the batch running now: which speculating requests may speculate in
        the next step (``gate_batch``; requests of device slots ride along)."""
        if self.break_even is None:
            return
        self.break_even.batch = max(len(running), 1)
        paced = [r for r in running if r.spec_state is not None]
        gate_batch([r.spec_pace for r in paced], len(running), self.break_even,
                   [on_device(r) for r in paced])

    def propose(self, running: list[Request], on_error: OnError) -> None:
        running = list(running)
        self.gate(running)
        self.worker.propose_all(running, on_error)

    def fill(self, batch: ScheduledBatch, on_error: OnError
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.worker.fill(batch, on_error)

    def launchable(self, batch: ScheduledBatch, device_samples: DeviceSamples) -> bool:
        """Device speculative plans (with plain rows beside them), or plain rows alone."""
        if self.device_step(batch):
            return True
        reqs = [r for r, _ in batch.items]
        return all(r.draft is None for r in reqs) and device_samples(reqs)

    def device_step(self, batch: ScheduledBatch) -> bool:
        """A step of plans proposed and verified on the device (DeviceSpecStep), and
        beside them only plain decode rows whose tokens the device samples alone (one
        token each, at the end of what the request has; ``batch.in_flight`` counts a
        token in flight)."""
        if self.runner.spec_step is None or not batch.items:
            return False
        plain = []
        for r, n in batch.items:
            if r.draft is None:
                if n != 1 or r.num_computed_tokens + 1 != r.num_tokens + batch.in_flight:
                    return False
                plain.append(r)
            elif r.draft.device_slot is None or n != r.draft.num_tokens:
                return False
        return len(plain) < len(batch.items) and (not plain or self.device_samples(plain))

    def after_forward(self, fwd) -> None:
        if fwd.spec_entries:
            self.worker.after_forward(fwd)

    def verdict(self, fwd, batch: ScheduledBatch) -> torch.Tensor | None:
        if not fwd.spec_entries:
            return None
        for r, _ in batch.items:
            r.draft = None  # a plan is one step's
        return fwd.spec.packed()

    def verify(self, batch: ScheduledBatch, fwd, result: StepResult, cache: KVCache,
               on_error: OnError) -> bool:
        """Host plans' logits rows go to the worker, device plans' verdicts were made in
        the forward; the worker's ``step`` (exception-safe) verifies and moves KV."""
        for req, (first, count) in fwd.draft_rows.items():
            if not req.is_finished and req not in fwd.spec_entries:
                result.draft_logits[req] = fwd.logits[first : first + count]
        result.spec_entries, result.spec = fwd.spec_entries, fwd.spec
        if not any(r.draft is not None for r, _ in batch.items):
            return False
        self.worker.step(batch, result, cache, on_error)
        return True

    def may_speculate(self, reqs: list[Request]) -> bool:
        """A paced request that is not speculating now decodes plainly next (its pacing
        decides again when the in-flight token is committed; a start then waits for the
        step after)."""
        return any(r.spec_state is not None and (r.spec_pace is None or r.spec_pace.active)
                   for r in reqs)

    def schedule_chain(self, cur: LaunchedStep, on_error: OnError
                       ) -> tuple[ScheduledBatch | None, tuple | None]:
        """The device state already holds ``cur``'s commits (the next x is its bonus token),
        and the device moves the step's positions and slots on by what ``cur`` committed.
        The chain stops when a request finished or pauses, requests wait, a length limit
        or the KV blocks are near."""
        reqs = cur.reqs
        if any(r.is_finished for r in reqs):
            return None, None
        self.gate(reqs)  # every request of a device slot here: all ride along, or none
        dev = [r for r in reqs if r not in cur.plain]
        if not any(r.spec_pace is None or r.spec_pace.active for r in dev):
            return None, None
        if not all(self.worker.chainable(r) for r in dev):
            return None, None
        self.worker.propose_batch(dev, on_error)
        batch = self._schedule_ahead(cur.batch, cur.plain)
        scatter = None
        try:
            if batch is not None and self.device_step(batch):
                scatter = self.fill(batch, on_error)
            else:
                batch = None
        except Exception as e:  # the plain scheduler's step retries request by request
            print(f"warning: a speculative step launched ahead could not draft "
                  f"({type(e).__name__}: {e}); the next step runs after this one",
                  file=sys.stderr, flush=True)
            batch = None
        if batch is None:
            for r in dev:
                r.draft = None
        return batch, scatter

    def _schedule_ahead(self, launched: ScheduledBatch, plain: list[Request]
                        ) -> ScheduledBatch | None:
        """The speculative step after ``launched`` (each item a device plan, or one of the
        ``plain`` rows beside them), scheduled before the host knows what it committed:
        the same requests, the plain rows first (one token each, its input the sample in
        flight: ``in_flight``), then each plan request with its next plan (``req.draft``),
        staged as if each committed one token (``spec_in_flight``); KV is allocated for the
        worst case, ``width`` committed. None, allocating nothing, when the next step needs
        the plain ``schedule``: a request finished or has no device plan, one waits that
        schedule() may admit, a length limit is within reach, or blocks run out."""
        sched, blocks, max_len = self.scheduler, self.scheduler.blocks, self.max_seq_len
        reqs = [r for r, _ in launched.items]
        plain_set = set(plain)
        plans = [r for r in reqs if r not in plain_set]
        if sched.admission_pending() or len(reqs) != len(sched.running) or any(
                r.is_finished or r.ends_on_length_after(1, max_len) for r in plain) or any(
                r.is_finished or r.draft is None or r.draft.device_slot is None
                or r.ends_on_length_after(self.width, max_len) for r in plans):
            return None
        targets = ([r.num_computed_tokens + 1 for r in plain]
                   + [r.num_computed_tokens + self.width - 1 + r.draft.num_tokens for r in plans])
        order = list(plain) + plans
        need = sum(max(0, blocks.blocks_needed(t) - len(r.block_table))
                   for r, t in zip(order, targets))
        if need > blocks.num_free_blocks:
            return None
        for r, t in zip(order, targets):
            blocks.allocate(r.block_table, t)
        return ScheduledBatch([(r, 1) for r in plain] + [(r, r.draft.num_tokens) for r in plans],
                              in_flight=1 if plain else 0, spec_in_flight=True)

    def after_commit(self, req: Request, num_new: int, verified: bool) -> None:
        self.worker.after_commit(req, num_new, verified)

    def release(self, req: Request) -> None:
        self.worker.release(req)


def make_proposer(spec: SpeculativeConfig, device_state: DeviceProposer | None,
                  draft: DraftModel | None, scheduler: Scheduler, runner,
                  device_samples: DeviceSamples, max_seq_len: int) -> StepProposer:
    """The engine's proposer for its recorded mode (``workers.MODES``), chosen once."""
    worker = make_worker(spec, device_state, draft)
    if worker is None:
        return StepProposer(spec)
    return SpeculativeProposer(spec, worker, scheduler, runner, device_samples, max_seq_len)
