"""Draft-model speculative decoding: a small model of the target's tokenizer drafts K tokens
per step, the target verifies them in one forward.

The draft has its own weights, model runner and KV cache tensors, but no blocks of its own:
its cache has as many blocks as the target's and a request's draft KV lives in the same
block ids as its target KV (the request's one block table). So the draft's KV is allocated,
freed, preempted and prefix-shared with its request by the target's block manager, and a
request that leaves the engine leaves nothing of the draft behind (vLLM v1 keeps its draft
layers in the target's KV cache groups the same way).

A step, for the requests whose draft plan was scheduled (``DraftModelWorker.fill``):
1. catch-up: the draft computes what it has not seen of each request (the prompt the first
   time, then the tokens the last verification accepted, at least x, the last committed
   token) and draws d1 from its last row;
2. K - 1 single-token decode steps, each one's input the previous draws, on the device
   (``input_patch``: no host sync between them);
3. the drafts [B, K] are written into the plans' rows of the target's inputs on the
   device, and the target's step verifies them (greedy: the longest matching prefix and
   the target's token after it; sampled: the standard rejection rule, accept d with
   probability min(1, p(d) / q(d)), else sample norm(max(0, p - q)); the output is
   distributed as plain sampling from p).

Where it is verified: requests without a grammar at the engine's K are verified on the
device (``DeviceDraft``, on by default on CUDA): greedy in the step's epilogue, sampled by
``verify_sampled`` right after the forward; the host reads what each committed, and the
step after it is launched before that read (``DraftModel.draft_ahead``: the async
pipeline). The rest (grammars, shorter K, device verification off) are verified on the
host (``DraftModelWorker.verify``), which reads the drafts with the target's rows: one
host sync per step.

Draft KV written for the accepted drafts is at its final positions (a chain), so after a
verification that accepted ``a`` of K drafts the draft has KV for ``n + min(a, K - 1)``
tokens (``n``: the request's tokens when it drafted, x included).

Failure isolation: a draft forward that raises for a batch is retried request by request;
a request whose own draft forward raises decodes that step with placeholder drafts (the
target's verification commits its correct token: it recovers), recomputes its draft KV
from scratch next time, and stops speculating after ``MAX_FAILURES`` such steps. The
request's blocks are its own either way.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.runtime.host_copy import to_device
from kiln.runtime.layers.sampler import warp_batch
from kiln.runtime.request import Request
from kiln.runtime.scheduler import ScheduledBatch
from kiln.runtime.speculative.device_draft import DeviceDraft
from kiln.runtime.speculative.draft import DraftPlan, DraftTree
from kiln.runtime.speculative.pace import BreakEven, DraftPace
from kiln.runtime.speculative.verify import reject_sampled
from kiln.runtime.speculative.worker import DraftWorker, OnError, walk_tree
from kiln.runtime.step import sample_logits

if TYPE_CHECKING:
    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.runtime.model_runner import ModelRunner

MAX_FAILURES = 3  # draft forwards that may fail for one request before it decodes plainly


@dataclass
class DraftState:
    """A request's draft-model state (``req.spec_state``)."""

    k: int = 1  # drafts per step (the request's max_draft_len, else the engine's)
    computed: int = 0  # leading tokens of the request with draft KV in its blocks
    epoch: int = 0  # the request's preemptions when ``computed`` was counted
    base: int = 0  # the request's tokens when this step drafted (x included)
    drafted: tuple[StepDrafts, int] | None = None  # this step's drafts: the batch's, its row
    q: torch.Tensor | None = None  # [K, V] the drafts' probabilities (sampled requests)
    failures: int = 0
    off: bool = False  # the draft failed MAX_FAILURES times: plain decoding from now on
    # verified on the device (DeviceDraft; any value: the engine's one state), or None
    slot: int | None = None
    # the draft ran for the request's last step: its KV covers every token but the last
    # committed step's, so the next step may launch ahead (``DraftModel.draft_ahead``)
    synced: bool = False
    pending: tuple = ()  # (a device slot's plain-step tokens: the draft reads the request's)
    device_drafts: torch.Tensor | None = None  # this step's drafts [K] on the device

    @property
    def drafts(self) -> list[int]:
        return self.drafted[0].row(self.drafted[1], self.k) if self.drafted is not None else []

    def valid(self, req: Request) -> int:
        """Tokens with draft KV now: none after a preemption (the blocks are new)."""
        if self.epoch != req.metrics.num_preemptions:
            self.epoch, self.computed = req.metrics.num_preemptions, 0
        return self.computed


class StepDrafts:
    """A step's drafts [B, K] on the device, read to the host once, by the first request
    verified (the target's forward is queued by then: the read does not stall it)."""

    def __init__(self, drafts: torch.Tensor) -> None:
        self.device = drafts
        self._host: list[list[int]] | None = None

    def row(self, i: int, k: int) -> list[int]:
        if self._host is None:
            self._host = self.device.tolist()
        return self._host[i][:k]


class GrammarWalk:
    """Structured-output requests draft under their grammar: each draw is masked by the
    request's matcher advanced over the drafts before it (a host read per draft step for
    those rows), and every matcher is rolled back when the drafting ends. A draft the
    grammar ends on stops the walk (later drafts are unconstrained; the target's guided
    verification ends the chain there)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab  # the matchers' (target's) vocabulary
        self.advanced: dict[Request, int] = {}
        self.stopped: set[Request] = set()

    def mask(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None
                and r not in self.stopped]
        if not rows:
            return logits
        mask = torch.zeros(len(rows), self.vocab, dtype=torch.bool)
        for j, i in enumerate(rows):
            try:
                reqs[i].matcher.fill_mask(mask[j])
            except Exception:  # unconstrained: the target's verification checks it
                mask[j] = True
        idx = to_device(rows, torch.long, logits.device)
        allowed = mask[:, : logits.shape[-1]].to(logits.device, non_blocking=True)
        logits = logits.clone()
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        return logits

    def advance(self, reqs: list[Request], toks: torch.Tensor) -> None:
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None
                and r not in self.stopped]
        if not rows:
            return
        for i, tok in zip(rows, toks[to_device(rows, torch.long, toks.device)].tolist()):
            req = reqs[i]
            if not req.matcher.accept(tok):
                self.stopped.add(req)
                continue
            self.advanced[req] = self.advanced.get(req, 0) + 1
            if req.matcher.is_terminated():
                self.stopped.add(req)

    def rollback(self) -> None:
        for req, n in self.advanced.items():
            req.matcher.rollback(n)
        self.advanced.clear()


class DraftSeq:
    """What the draft's model runner reads of a request: its token ids (drafts in flight are
    0 placeholders, patched on the device), the draft's computed count, and the request's own
    block table (shared: the draft's KV goes in the same blocks)."""

    __slots__ = ("all_token_ids", "block_table", "draft", "num_computed_tokens", "req")
    prompt_logprobs = None  # the draft scores no prompt (ScheduledBatch.prompt_positions)

    def __init__(self, req: Request, computed: int) -> None:
        self.req = req
        self.all_token_ids = list(req.all_token_ids)
        self.num_computed_tokens = computed
        self.block_table = req.block_table
        self.draft = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModel:
    """The draft model's runner and how it draws drafts.

    ``vocab``: the token ids drafts may take, min(draft, target) embedding rows (padded
    tables differ in size: Qwen2.5-0.5B has 151,936 rows, 7B 152,064; no token of the
    shared tokenizer lies past the smaller one). ``max_tokens``: tokens per draft forward
    (the engine's token budget; longer catch-ups run in chunks).
    """

    def __init__(self, runner: ModelRunner, vocab: int, max_tokens: int,
                 target_vocab: int | None = None) -> None:
        self.runner = runner
        self.vocab = vocab
        self.target_vocab = target_vocab or vocab
        self.max_tokens = max_tokens
        self.device = runner.device

    def draft(self, reqs: list[Request], ks: list[int]) -> tuple[torch.Tensor, list[list]]:
        """``ks[i]`` drafts for request i -> (drafts [B, max(ks)] on the device, row i's
        first ``ks[i]`` valid; per request its probability rows [V] (sampled requests;
        empty for greedy ones)). Queued on the device, no host sync."""
        walk = GrammarWalk(self.target_vocab)
        try:
            return self._draft(reqs, ks, walk)
        finally:
            walk.rollback()

    def draft_ahead(self, reqs: list[Request], state: DeviceDraft
                    ) -> tuple[torch.Tensor, list[list]]:
        """x and K drafts [B, K + 1] for device-verified requests whose last step (their
        entry rows 0..B-1 of ``state``, in order) is still in flight, and per request its
        drafts' probability rows (sampled requests; ``draft``'s). The host knows each
        request's tokens up to that step's x, n of them. The draft runs the token before
        the new x and the new x (``DeviceDraft.next_inputs``), laid out at n - 1 and n as
        if the step committed one token and moved on by what it committed beyond one on the
        device, then K - 1 decode steps. Queued on the device, no host sync."""
        b, k = len(reqs), state.max_draft_len
        walk = GrammarWalk(self.target_vocab)  # device requests have no grammar: a no-op
        pair, counts = state.next_inputs(b)
        seqs = []
        for r in reqs:
            s = DraftSeq(r, r.num_tokens - 1)
            s.all_token_ids.append(0)  # the new x, in flight
            seqs.append(s)
        rows = torch.arange(2 * b, device=self.device)
        out = self.runner.execute(ScheduledBatch([(s, 2) for s in seqs]),
                                  scatter=(rows, pair.reshape(-1)), counts=counts)
        drafts = torch.empty(b, k + 1, dtype=torch.long, device=self.device)
        drafts[:, 0] = pair[:, 1]
        toks, qs = self._draw(sample_logits(out)[1], reqs, walk)
        probs = [[q] if q is not None else [] for q in qs]
        drafts[:, 1] = toks
        for s in seqs:
            s.num_computed_tokens += 2
        for j in range(2, k + 1):
            toks, qs = self._decode_step(seqs, reqs, toks, walk, counts)
            drafts[:, j] = toks
            for q, acc in zip(qs, probs):
                if q is not None:
                    acc.append(q)
        return drafts, probs

    def _draft(self, reqs: list[Request], ks: list[int], walk: GrammarWalk
               ) -> tuple[torch.Tensor, list[list]]:
        seqs = [DraftSeq(r, r.spec_state.valid(r)) for r in reqs]
        toks, qs = self._draw(self._catch_up(seqs), reqs, walk)
        b, kmax = len(reqs), max(ks)
        drafts = torch.zeros(b, kmax, dtype=torch.long, device=self.device)
        drafts[:, 0] = toks
        probs = [[q] if q is not None else [] for q in qs]
        rows = list(range(b))  # each drafting sequence's row of ``drafts``
        for j in range(1, kmax):
            live = [n for n, i in enumerate(rows) if ks[i] > j]
            if len(live) < len(rows):  # the requests of shorter drafts are done
                toks = toks[to_device(live, torch.long, self.device)]
                seqs, rows = [seqs[n] for n in live], [rows[n] for n in live]
            toks, qs = self._decode_step(seqs, [reqs[i] for i in rows], toks, walk)
            if len(rows) == b:
                drafts[:, j] = toks
            else:
                drafts[to_device(rows, torch.long, self.device), j] = toks
            for i, q in zip(rows, qs):
                if q is not None:
                    probs[i].append(q)
        return drafts, probs

    def _decode_step(self, seqs: list[DraftSeq], reqs: list[Request], toks: torch.Tensor,
                     walk: GrammarWalk, counts: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One draft decode step of ``seqs``, its inputs the last draws ``toks`` on the
        device (``counts``: moved on as ``ModelRunner.execute`` says); the next draws."""
        for s in seqs:
            s.all_token_ids.append(0)  # the draw in flight, patched on the device
        batch = ScheduledBatch([(s, 1) for s in seqs])
        out = (self.runner.execute(batch, toks) if counts is None
               else self.runner.execute(batch, toks, counts=counts))
        for s in seqs:
            s.num_computed_tokens += 1
        # one row per sequence, in batch order: a view (sample_logits)
        return self._draw(sample_logits(out)[1], reqs, walk)

    def _catch_up(self, seqs: list[DraftSeq]) -> torch.Tensor:
        """Forward what the draft has not computed of each sequence (x at least), in chunks
        of at most ``max_tokens``; returns each sequence's last row's logits [B, V]."""
        rows: dict[DraftSeq, torch.Tensor] = {}
        while True:
            budget, items = self.max_tokens, []
            for s in seqs:
                n = min(s.num_tokens - s.num_computed_tokens, budget)
                if n > 0:
                    items.append((s, n))
                    budget -= n
                if budget == 0:
                    break
            if not items:
                break
            out = self.runner.execute(ScheduledBatch(items))
            for s, row in out.sample_rows.items():
                rows[s] = out.logits[row]
            for s, n in items:
                s.num_computed_tokens += n
        return torch.stack([rows[s] for s in seqs])

    def _draw(self, logits: torch.Tensor, reqs: list[Request], walk: GrammarWalk
              ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One draft token per row on the device [B] (greedy: the argmax; sampled: a draw
        from the request's warped distribution q, whose row is returned too; under its
        grammar for a structured-output request)."""
        logits = walk.mask(logits[:, : self.vocab], reqs)
        toks = logits.argmax(-1)
        qs: list[torch.Tensor | None] = [None] * len(reqs)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            q = warp_batch(logits[sampled], [reqs[i].params for i in sampled])
            # an exponential race (Gumbel-max on probabilities)
            drawn = (q / race_noise([reqs[i] for i in sampled], q.shape[-1], q.device)
                     ).argmax(-1)
            toks[to_device(sampled, torch.long, toks.device)] = drawn
            for j, i in enumerate(sampled):
                qs[i] = q[j]
        walk.advance(reqs, toks)
        return toks, qs


class DraftModelWorker(DraftWorker):
    """Draft-target speculative decoding over a ``DraftModel`` (host-verified chains of K)."""

    name = "draft"

    def __init__(self, draft: DraftModel, max_draft_len: int,
                 device: DeviceDraft | None = None) -> None:
        """``device``: the engine's ``DeviceDraft`` (verification on the device, steps
        launched ahead), or None (every request verified on the host)."""
        super().__init__(device)
        self.draft_model = draft
        self.k = max_draft_len

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, device: DeviceDraft | None,
                    draft: DraftModel | None) -> DraftModelWorker:
        if draft is None:
            raise ValueError("a draft-model engine needs its draft model: load the engine "
                             "with LLMEngine.from_engine_dir (it reads ENGINE/draft)")
        return cls(draft, spec.max_draft_len, device)

    def init_request(self, req: Request, window: tuple[int, int, int]) -> None:
        k = req.params.max_draft_len
        st = DraftState(k=self.k if k is None else k, epoch=req.metrics.num_preemptions)
        req.spec_state = st
        if st.k == self.k and self.may_take_slot(req):
            st.slot = 0

    def after_forward(self, fwd) -> None:
        """A step's device plans of sampled requests: the step's epilogue verified them
        greedily; the standard rule replaces that (``verify_sampled``)."""
        sampled = [r for r in fwd.spec_entries if not r.params.greedy]
        if sampled:
            verify_sampled(sampled, fwd, self.device)
        for r in fwd.spec_entries:
            r.spec_state.device_drafts = None

    def release(self, req: Request) -> None:
        req.spec_state.slot = None  # nothing held: every request may use the entry rows

    def device_plan(self, req: Request) -> DraftPlan:
        """x and K placeholders, verified on the device (the drafts are drawn by ``fill``;
        a step launched ahead writes x too)."""
        return DraftPlan([req.all_token_ids[-1]] * (self.k + 1), device_slot=0)

    def chainable(self, req: Request) -> bool:
        """Whether the step after the one in flight may launch ahead for ``req``: the draft
        ran for that step (else its KV has a gap the two-token catch-up does not fill)."""
        return req.spec_state.synced

    def on_commit(self, req: Request, num_new: int, verified: bool) -> None:
        """After a device-verified step: the draft has KV for x and the accepted drafts
        but the K-th (the host worker's ``verify`` counts the same for its steps)."""
        st = req.spec_state
        if verified and st.slot is not None and st.synced:
            st.computed = req.num_tokens - num_new + min(num_new - 1, st.k - 1)

    def shadow_proposer(self, req: Request):
        raise NotImplementedError("a draft model has no shadow proposer: what it proposes "
                                  "is known only by running it (``pace``: DraftPace)")

    def pace(self, req: Request, break_even: BreakEven) -> DraftPace:
        return DraftPace(break_even)

    def propose(self, req: Request) -> DraftPlan | None:
        """x and K placeholders: the drafts are drawn once the step is scheduled (``fill``),
        when the step's KV blocks (which the draft writes too) are allocated."""
        if req.spec_state.off:
            return None
        x = req.all_token_ids[-1]
        return DraftPlan([x] * (req.spec_state.k + 1))

    def fill(self, batch: ScheduledBatch, on_error: OnError
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Draw the drafts of the plans this step runs, on the device; returns them with
        their rows of the step's inputs (the plans hold placeholders there). A step launched
        ahead (``batch.spec_in_flight``: device plans only) writes each plan's x too, and
        an error there goes to the caller (the engine then runs the step after the one in
        flight through the plain scheduler, which retries request by request)."""
        if batch.spec_in_flight:
            return self._fill_ahead(batch)
        reqs = [r for r, n in batch.items
                if r.draft is not None and r.draft.num_tokens == n and not r.is_finished]
        if not reqs:
            return None
        drawn: dict[Request, torch.Tensor] = {}
        try:
            drawn.update(self._fill(reqs))
        except Exception:
            for req in reqs:  # which request's draft failed: each alone
                try:
                    drawn.update(self._fill([req]))
                except Exception as e:
                    self._draft_failed(req, e)
        if not drawn:
            return None
        rows, q0 = [], 0
        for req, n in batch.items:
            if req in drawn:
                rows.extend(range(q0 + 1, q0 + n))
            q0 += n
        ids = torch.cat([drawn[r] for r, _ in batch.items if r in drawn])
        return to_device(rows, torch.long, ids.device), ids

    def _fill_ahead(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        plans, rows, q0 = [], [], 0
        for req, n in batch.items:
            if req.draft is not None and req.draft.num_tokens == n:
                plans.append(req)
                rows.extend(range(q0, q0 + n))
            q0 += n
        drafts, qs = self.draft_model.draft_ahead(plans, self.device)
        for i, (req, q) in enumerate(zip(plans, qs)):
            req.spec_state.q = torch.stack(q) if q else None
            req.spec_state.device_drafts = drafts[i, 1:]
        return to_device(rows, torch.long, drafts.device), drafts.reshape(-1)

    def _fill(self, reqs: list[Request]) -> dict[Request, torch.Tensor]:
        ks = [r.spec_state.k for r in reqs]
        drafts, qs = self.draft_model.draft(reqs, ks)
        step = StepDrafts(drafts)
        for i, (req, q) in enumerate(zip(reqs, qs)):
            st = req.spec_state
            st.base, st.drafted, st.synced = req.num_tokens, (step, i), True
            st.q = torch.stack(q) if q else None
            st.device_drafts = drafts[i, : st.k]
            req.draft.data = st
        return {r: d[:k] for r, d, k in zip(reqs, drafts, ks)}

    def _draft_failed(self, req: Request, e: BaseException) -> None:
        """The request's draft forward raised: this step verifies placeholder drafts (the
        target commits its own token), its draft KV is recomputed next time."""
        st = req.spec_state
        st.computed, st.drafted, st.q, st.failures = 0, None, None, st.failures + 1
        st.synced = False
        req.draft.data = None
        st.off = st.failures >= MAX_FAILURES
        if st.off:
            st.slot = None  # plain decoding: no device plans either
        print(f"warning: request {req.request_id}: the draft model's forward failed "
              f"({type(e).__name__}: {e}); this step decodes without drafts"
              + ("; it decodes plainly from now on" if st.off else ""),
              file=sys.stderr, flush=True)

    def verify(self, req: Request, logits: torch.Tensor, argmax: list[int]
               ) -> tuple[list[int], list[tuple[int, int]]]:
        st: DraftState | None = req.draft.data
        drafts = st.drafts if st is not None else []  # none: the draft failed this step
        if req.matcher is not None or req.params.greedy:  # (under the grammar, if any)
            accepted, _, _ = walk_tree(req, logits, argmax, DraftTree.chain(drafts).children())
        elif drafts:
            accepted = self._rejection(req, logits, drafts, st.q)
        else:
            p = warp_batch(logits[:1], [req.params])[0]
            accepted = [int(torch.multinomial(p.double().cpu(), 1, generator=req.generator))]
        if st is not None:
            st.computed = st.base + min(len(accepted) - 1, len(drafts) - 1)
        return accepted, []  # a chain: accepted rows already sit at their final indices

    @staticmethod
    def _rejection(req: Request, logits: torch.Tensor, drafts: list[int],
                   q: torch.Tensor) -> list[int]:
        """The standard rule (Leviathan et al. 2023; Chen et al. 2023): accept draft i with
        probability min(1, p_i(d) / q_i(d)); at the first rejection sample from
        norm(max(0, p_i - q_i)) and stop; all accepted: the bonus token from p_K."""
        k = len(drafts)
        p = warp_batch(logits[: k + 1], [req.params] * (k + 1))  # [K+1, V_target]
        v = min(p.shape[-1], q.shape[-1])
        qf = torch.zeros_like(p[:k])
        qf[:, :v] = q[:, :v]
        idx = torch.arange(k, device=p.device)
        d = torch.tensor(drafts, device=p.device)
        pd, qd = torch.stack([p[idx, d], qf[idx, d]]).double().cpu().tolist()
        u = torch.rand(k, generator=req.generator, dtype=torch.float64).tolist()
        out: list[int] = []
        for i in range(k):
            if u[i] * qd[i] < pd[i]:  # u < p/q, i.e. min(1, p/q)
                out.append(drafts[i])
                continue
            residual = (p[i] - qf[i]).clamp_(min=0)
            if float(residual.sum()) <= 0.0:  # p == q to rounding: p itself
                residual = p[i]
            out.append(int(torch.multinomial(residual.double().cpu(), 1,
                                             generator=req.generator)))
            return out
        out.append(int(torch.multinomial(p[k].double().cpu(), 1, generator=req.generator)))
        return out


def race_noise(reqs: list[Request], vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [len(reqs), vocab] for exponential races (argmax of p / E draws from
    p): a seeded request's row from a device generator seeded by its own generator (the
    same draws in any batch), the others' from the default generator in one launch."""
    noise = torch.empty(len(reqs), vocab, device=device)
    seeded = [i for i, r in enumerate(reqs) if r.generator is not None]
    if len(seeded) < len(reqs):
        noise.exponential_()
    for i in seeded:
        gen = torch.Generator(device=device)
        gen.manual_seed(int(torch.randint(0, 2**62, (), generator=reqs[i].generator)))
        noise[i].exponential_(generator=gen)
    return noise.clamp_min_(1e-20)  # E = 0 would make 0 / 0


def verify_sampled(reqs: list[Request], fwd, state: DeviceDraft) -> None:
    """The standard rule (``DraftModelWorker._rejection``'s) on the device for sampled
    requests' device plans of a step, in place of the epilogue's greedy verdict: accept
    draft i with probability min(1, p_i(d) / q_i(d)); at the first rejection draw from
    norm(max(0, p_i - q_i)), after K acceptances from p_K (an exponential race). Writes
    each request's committed tokens and count into the step's ``fwd.spec`` rows and
    ``state`` (what the step launched ahead reads). Uniforms come from the request's
    generator, the races' noise from a device generator seeded by it: a seeded request
    verifies the same in any batch. No host sync."""
    dev = fwd.logits.device
    m, k = len(reqs), state.max_draft_len
    rows = [fwd.draft_rows[r][0] + j for r in reqs for j in range(k + 1)]
    logits = fwd.logits[to_device(rows, torch.long, dev)]
    p = warp_batch(logits, [r.params for r in reqs for _ in range(k + 1)])
    v = p.shape[-1]
    p = p.view(m, k + 1, v)
    qf = torch.zeros(m, k, v, dtype=p.dtype, device=dev)
    drew = [r.spec_state.q is not None and r.spec_state.device_drafts is not None
            for r in reqs]  # else its draft failed: the step samples its token from p
    for i, r in enumerate(reqs):
        if drew[i]:
            q = r.spec_state.q
            w = min(v, q.shape[-1])
            qf[i, : q.shape[0], :w] = q[:, :w]
    d = torch.stack([r.spec_state.device_drafts if ok else
                     torch.zeros(k, dtype=torch.long, device=dev) for r, ok in zip(reqs, drew)])
    u = to_device([x for r in reqs for x in torch.rand(k, generator=r.generator,
                                                         dtype=torch.float64).tolist()],
                  torch.float32, dev).view(m, k)
    committed, count = reject_sampled(
        p, qf, d, None if all(drew) else to_device(drew, torch.float32, dev), u,
        race_noise(reqs, v, dev))
    e = to_device([fwd.spec_entries[r] for r in reqs], torch.long, dev)
    fwd.spec.committed[e] = committed.to(fwd.spec.committed.dtype)
    fwd.spec.count[e] = count.to(fwd.spec.count.dtype)
    state.last_tokens[e, 1:] = committed
    state.last_count[e] = count
