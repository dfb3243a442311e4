"""Token-budget continuous batching (the vLLM v1 rule).

Each step hands out at most ``max_num_tokens`` tokens: running requests first (decode
tokens or the next prefill chunk), then waiting requests in arrival order. Prefill is
chunked by construction: a request gets ``min(remaining, budget)`` tokens. When KV blocks
run out, the most recently admitted running request is preempted (its blocks freed, it
recomputes later from ``num_computed_tokens = 0``); nothing is lost.

Admission reserves KV (``reserve=True``, the default): a waiting request is admitted only
while the free blocks hold its expected KV and the growth still expected of every running
request (``expected_tokens``: prompt + max_tokens where the length is known, ignore_eos;
otherwise prompt + the mean output of recently finished requests, at most max_tokens). A
pool that admits more than it can hold otherwise preempts, and the preempted recompute
(llama-3-8b bf16 on an H100, 768 requests of 1000/1000 at batch 512: 438 preemptions and
541k recomputed tokens in a simulation of this scheduler that matched the measured run's
3,020 steps; docs/decisions.md, "Admission reserves KV"). With the reservation wrong (a
request outgrows the estimate) preemption still recovers. The first request is always
admitted: one that fits the pool alone always runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kiln.runtime.kv_cache import BlockManager
from kiln.runtime.request import Request, Status


# How many finished requests' output lengths estimate an unknown one, and the estimate
# before any finished.
OUTPUT_HISTORY = 64
UNKNOWN_OUTPUT_TOKENS = 512


@dataclass
class ScheduledBatch:
    """What one step computes: ``(request, num_new_tokens)`` in batch order."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Tokens each request has in a step on the device whose samples the host has not read:
    # the last ``in_flight`` input ids of each item come from the device (``input_patch``).
    in_flight: int = 0
    # A speculative step launched before the one in flight committed (device plans, and
    # plain rows beside them): its plans staged as if that step committed one token, moved
    # on by the device (device_step.py).
    spec_in_flight: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def input_ids(self, req: Request, start: int, end: int) -> list[int]:
        """Token ids at positions start..end-1; 0 stands for those still in flight (the
        device writes them over)."""
        ids = req.all_token_ids[start:end]
        return ids + [0] * (end - start - len(ids))

    def samples(self, req: Request, end: int) -> bool:
        """Whether ``req``'s item, computing up to position ``end``, reaches its last token
        (its logits give the next token): its last known token, or the token in flight."""
        return end >= req.num_tokens

    def prompt_positions(self, req: Request, start: int, end: int) -> tuple[int, int]:
        """Positions ``lo..hi-1`` of ``req``'s item (computing ``start..end-1``) whose logits
        score prompt tokens its prompt logprobs still lack (position p scores prompt token
        p + 1); ``lo == hi``: none."""
        got = req.prompt_logprobs
        if got is None:
            return end, end
        lo = max(start, len(got) - 1)
        return lo, max(lo, min(end, req.num_prompt_tokens - 1))

    def num_prompt_rows(self) -> int:
        """Logits rows the step computes to score prompt tokens (``prompt_positions``)."""
        rows = 0
        for r, n in self.items:
            if r.prompt_logprobs is not None:
                lo, hi = self.prompt_positions(r, r.num_computed_tokens,
                                               r.num_computed_tokens + n)
                rows += hi - lo
        return rows

    def unfinished(self) -> ScheduledBatch:
        """The items whose request has not stopped, failed or been aborted since."""
        return ScheduledBatch([(r, n) for r, n in self.items if not r.is_finished])

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    """Owns the waiting queue and the running list; allocates blocks through BlockManager."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_tokens: int,
                 max_seq_len: int | None = None, reserve: bool = True):
        if max_num_seqs < 1 or max_num_tokens < 1:
            raise ValueError(
                f"max_num_seqs={max_num_seqs} and max_num_tokens={max_num_tokens} must be >= 1"
            )
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_seq_len = max_seq_len
        self.reserve = reserve
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # output lengths of the last finished requests (the estimate of an unknown length)
        self._outputs: deque[int] = deque(maxlen=OUTPUT_HISTORY)
        self._outputs_sum = 0
        # The reservation kept the next waiting request out, and no blocks were freed since:
        # it stays out (a running request's allocation takes as much from the free blocks as
        # from its expected growth), without summing the running requests' growth each step.
        self._held = False

    def expected_tokens(self, req: Request) -> int:
        """The tokens ``req`` is expected to hold when it ends: prompt + max_tokens under
        ignore_eos (the length is known), else prompt + the mean output of the last
        finished requests (``UNKNOWN_OUTPUT_TOKENS`` before any), at most max_tokens; never
        past max_seq_len nor below what it holds now."""
        out = req.params.max_tokens
        if not req.params.ignore_eos:
            mean = (-(-self._outputs_sum // len(self._outputs)) if self._outputs
                    else UNKNOWN_OUTPUT_TOKENS)
            out = min(out, mean)
        total = req.num_prompt_tokens + out
        if self.max_seq_len is not None:
            total = min(total, self.max_seq_len)
        return max(total, req.num_tokens)

    def admission_pending(self) -> bool:
        """Whether schedule() may admit a waiting request: one waits, and the KV reservation
        does not hold it out (one it holds would not be admitted: steps launched ahead need
        not wait for the host on its account)."""
        return bool(self.waiting) and not self._held

    def _growth_blocks(self, reqs: Iterable[Request]) -> int:
        """Blocks ``reqs`` are still expected to allocate (``expected_tokens``)."""
        need = self.blocks.blocks_needed
        return sum(max(0, need(self.expected_tokens(r)) - len(r.block_table)) for r in reqs)

    def add(self, req: Request) -> None:
        max_tokens = self.blocks.num_blocks * self.blocks.block_size
        if req.num_tokens + 1 > max_tokens:
            raise ValueError(
                f"prompt of {req.num_tokens} tokens cannot fit the KV cache of {max_tokens} "
                "tokens; shorten the prompt or give the engine more KV blocks"
            )
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_tokens
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.num_tokens - req.num_computed_tokens
            if req.draft is not None:
                # A draft step goes whole or not at all (then it is a plain decode step).
                if n == 1 and req.draft.num_tokens <= budget:
                    n = req.draft.num_tokens
                else:
                    req.draft = None
            n = min(n, budget)
            target = req.num_computed_tokens + n
            while not self.blocks.can_allocate(req.block_table, target):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break  # req preempted itself: everything after it is gone too
            self.blocks.allocate(req.block_table, target)
            batch.items.append((req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int,
                          admit: Callable[[Request], bool] | None = None) -> None:
        reserved = None  # the running requests' expected growth, in blocks (``reserve``)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if admit is not None and not admit(req):
                break  # in arrival order: it waits for the plain schedule
            if self.reserve and self.running:
                if self._held:
                    break
                if reserved is None:
                    reserved = self._growth_blocks(self.running)
                mine = self._growth_blocks((req,))
                if reserved + mine > self.blocks.num_free_blocks:
                    self._held = True  # until running requests finish (nothing is preempted)
                    break
                reserved += mine
            cached_blocks: list[int] = []
            # a request scoring its prompt computes every position (vLLM skips hits too)
            if req.num_computed_tokens == 0 and not req.block_table and not req.scores_prompt:
                cached_blocks, hashes = self.blocks.match_prefix(req.all_token_ids)
                req.block_table.extend(cached_blocks)
                req.block_hashes = hashes
                req.num_computed_tokens = len(cached_blocks) * self.blocks.block_size
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            target = req.num_computed_tokens + n
            if not self.blocks.can_allocate(req.block_table, target):
                self.blocks.free(req.block_table)  # give back the prefix hits
                req.block_hashes = []
                req.num_computed_tokens = 0
                break
            self.blocks.allocate(req.block_table, target)
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
                req.metrics.num_cached_prompt_tokens = len(cached_blocks) * self.blocks.block_size
            self.running.append(req)
            batch.items.append((req, n))
            budget -= n

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self._held = False
        self.running.remove(req)
        self.blocks.free(req.block_table)
        req.block_hashes = []
        req.draft = None
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req)
        # A request already placed in this batch cannot be preempted: victims are taken
        # from the tail, and the tail has not been scheduled yet at this point.
        if any(r is req for r, _ in batch.items):
            raise RuntimeError(f"preempted request {req.request_id} that was already scheduled")

    def schedule_ahead(self, launched: ScheduledBatch, max_seq_len: int,
                       admit: Callable[[Request], bool] | None = None) -> ScheduledBatch | None:
        """The step after ``launched``, scheduled before its samples reach the host (async
        scheduling). First one token for each request that sampled in ``launched``, its
        input the sample in flight (``in_flight``: these items lead, in ``launched``'s
        order); then, with ``admit`` (which requests the device alone may sample), what
        ``schedule`` would add: the next chunk of each running request with known tokens
        left (a prompt in chunks), and waiting requests ``admit`` accepts, with the token
        budget left. Without ``admit`` only a pure decode step is scheduled ahead.

        ``launched`` was queued on the device and its KV counted (``after_step``). None,
        allocating nothing, when the next step needs the plain ``schedule``: a request
        finished, blocks run out for the decodes (``schedule`` then preempts), a running
        request with tokens left, or the next waiting one while a slot is free, is not one
        ``admit`` accepts (it would wait behind steps launched ahead), nothing would run, or
        (without ``admit``) ``launched`` did not sample every running request or waiting
        requests would be admitted. A chunk or an admission that does not fit the free
        blocks waits for a later step (nothing is preempted ahead).
        """
        reqs = [r for r, _ in launched.items]
        if any(r.is_finished for r in reqs):
            return None
        if admit is None and (len(reqs) != len(self.running)
                              or any(r.num_computed_tokens != r.num_tokens for r in reqs)):
            return None
        # a request whose sample is in flight has computed every token it has
        cont = [r for r in reqs if r.num_computed_tokens == r.num_tokens
                and not r.ends_on_length_after(1, max_seq_len)]
        rest = [r for r in self.running if r.num_computed_tokens < r.num_tokens]
        admits = self.admission_pending()
        if admit is None and (not cont or (admits and len(cont) < self.max_num_seqs)):
            return None
        if rest and (admit is None or any(r.draft is not None or not admit(r) for r in rest)):
            return None
        if (admit is not None and admits and len(self.running) < self.max_num_seqs
                and not admit(self.waiting[0])):
            return None  # the next in line needs the host: schedule() admits it now
        need = sum(self.blocks.blocks_needed(r.num_computed_tokens + 1) - len(r.block_table)
                   for r in cont)
        if need > self.blocks.num_free_blocks:
            return None
        for r in cont:
            self.blocks.allocate(r.block_table, r.num_computed_tokens + 1)
        batch = ScheduledBatch([(r, 1) for r in cont], in_flight=1 if cont else 0)
        budget = self.max_num_tokens - len(cont)
        for r in rest:
            if budget <= 0:
                break
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if not self.blocks.can_allocate(r.block_table, r.num_computed_tokens + n):
                break
            self.blocks.allocate(r.block_table, r.num_computed_tokens + n)
            batch.items.append((r, n))
            budget -= n
        else:
            if admit is not None:
                self._schedule_waiting(batch, budget, admit)
        return batch if batch.items else None

    def after_step(self, batch: ScheduledBatch, advance: dict[Request, int] | None = None) -> None:
        """Advance computed counts, register full blocks in the prefix cache.

        ``advance`` overrides the scheduled count for requests whose step kept fewer tokens'
        KV (speculative steps keep x and the accepted drafts only).
        """
        advance = advance or {}
        for req, n in batch.items:
            req.num_computed_tokens += advance.get(req, n)
            self.blocks.cache_full_blocks(
                req.block_table, req.block_hashes, req.all_token_ids, req.num_computed_tokens
            )

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and free its blocks; the output length of
        one that ended by itself (a stop or a length limit) feeds ``expected_tokens``."""
        self._held = False
        if req.finish_reason in ("stop", "length"):
            if len(self._outputs) == self._outputs.maxlen:
                self._outputs_sum -= self._outputs[0]
            self._outputs.append(len(req.output_token_ids))
            self._outputs_sum += len(req.output_token_ids)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.blocks.free(req.block_table)
        req.block_hashes = []
