"""Turns a scheduled batch into model inputs, runs the model, returns the logits it needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.runtime.cuda_graph import CudaGraphRunner, report_capture_failures
from kiln.runtime.host_copy import to_device
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import AttentionMetadata, SeqAttention
from kiln.runtime.models.llama import LlamaModel
from kiln.runtime.request import Request
from kiln.runtime.scheduler import ScheduledBatch
from kiln.runtime.speculative.device_step import DeviceSpecStep, SpecOutput, shift_rows
from kiln.runtime.speculative.verify import SpecEntries
from kiln.runtime.staging import StepStager


@dataclass
class ForwardOutput:
    """Logits [rows, vocab] (float32) and which rows belong to whom.

    ``sample_rows``: requests whose step reached their last token -> their one logits row.
    ``draft_rows``: requests that ran a draft plan -> (first row, count) of the plan's rows.
    ``spec_entries``: requests whose plan ran on the device (``DraftPlan.device_slot``) ->
    their row of ``spec``, what the step verified and committed for them on the device.
    ``prompt_rows``: requests scoring their prompt (``SamplingParams.prompt_logprobs``) ->
    (first row, count, first position p): rows first .. first+count-1 are the logits of
    positions p .. p+count-1, which score prompt tokens p+1 .. p+count. They come after every
    other row of the step (sample and draft rows keep their places).
    """

    logits: torch.Tensor
    sample_rows: dict[Request, int] = field(default_factory=dict)
    draft_rows: dict[Request, tuple[int, int]] = field(default_factory=dict)
    spec_entries: dict[Request, int] = field(default_factory=dict)
    spec: SpecOutput | None = None
    prompt_rows: dict[Request, tuple[int, int, int]] = field(default_factory=dict)


class ModelRunner:
    """Owns the model and the KV cache tensors; one ``execute`` per engine step."""

    def __init__(self, model: LlamaModel, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        # Set by the engine for the Triton path: host->device staging of every step, and the
        # CUDA graphs (which read the stager's buffers). None: the reference path below.
        self.stager: StepStager | None = None
        self.graphs: CudaGraphRunner | None = None
        # Set by the engine when speculative state lives on the device (lookahead or prompt
        # lookup): plans of its slots are proposed and verified around the forward (in
        # masked buckets' graphs, captured).
        self.spec_step: DeviceSpecStep | None = None
        # Rank 0 of a tensor-parallel engine (kiln.runtime.parallel.control.LeaderModel): what
        # this runner runs, the other ranks run too (an eager forward's inputs, or a staged
        # step's buffers and which graph it replays), sent first. None: one rank.
        self.leader = None
        self._moved: dict[tuple[int, int], SpecEntries] = {}  # execute(counts=)'s entries

    def use_staging(self, max_seqs: int, max_num_tokens: int, max_seq_len: int,
                    tokens_per_step: int) -> None:
        """Stage every step through fixed host/device buffers (the Triton path) sized for
        ``max_seqs`` sequences of up to ``tokens_per_step`` tokens (speculative steps) or
        ``max_num_tokens`` in all, with room for a full request plus one speculative step.

        A block-table row covers that request, and at least ``max_seqs`` tokens: a CUDA
        graph's padding sequence takes a bucket's leftover tokens as its context (staging.py)
        and reads its row that far; decode buckets hold up to ``max_seqs`` tokens (the other
        buckets are capped at the row's capacity, cuda_graph.plan_buckets), which is more
        than one request when max_batch_size exceeds max_seq_len."""
        tokens = max(max_seq_len + tokens_per_step, max_seqs)
        self.stager = StepStager(
            max_seqs, max(max_num_tokens, max_seqs * tokens_per_step),
            -(-tokens // self.block_size), self.block_size,
            max_seqs * tokens_per_step ** 2 if tokens_per_step > 1 else 0, self.device)

    def capture_graphs(self, max_seqs: int, max_num_tokens: int, tokens_per_step: int,
                       max_graph_tokens: int, prefill: bool, strict: bool = False) -> float:
        """Capture the CUDA graphs of the staged path (``use_staging`` first); seconds.
        ``strict``: a bucket that fails to capture raises (tensor-parallel ranks must hold
        the same graphs) instead of running eagerly."""
        self.graphs = CudaGraphRunner(self.model, self.cache, self.stager, max_seqs,
                                      max_num_tokens, tokens_per_step, max_graph_tokens,
                                      prefill=prefill, spec_step=self.spec_step)
        seconds = self.graphs.capture(strict=strict)
        report_capture_failures(self)
        return seconds

    def slots_of(self, block_table: list[int], indices: list[int] | torch.Tensor) -> torch.Tensor:
        """Cache slots of a request's token indices (CPU LongTensor)."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[idx // self.block_size] * self.block_size + idx % self.block_size

    def execute(self, batch: ScheduledBatch, input_patch: torch.Tensor | None = None,
                scatter: tuple[torch.Tensor, torch.Tensor] | None = None,
                counts: torch.Tensor | None = None) -> ForwardOutput:
        """Run one forward over the batch.

        A request scheduled with exactly its draft plan's token count runs the plan (tree
        mask, positions from the plan, logits for every row); others run their next
        ``n`` tokens causally and get logits only when they reach their last token, and at
        the prompt positions whose logprobs they still lack (``ForwardOutput.prompt_rows``).
        ``input_patch`` (device token ids [k]) replaces the first k input tokens on the
        device: a step scheduled before the previous step's tokens reached the host
        (``batch.in_flight``: every item then is one decode token, row i = item i).
        ``scatter`` (input rows [k], token ids [k], on the device) writes token ids drawn on
        the device into the step's inputs (a draft model's drafts, into its plans' rows).
        ``counts`` (device [num_seqs], every item the same number of tokens): a step laid
        out before the step in flight committed, as if that step committed one token; item
        i's positions, cache slots and context move on by ``counts[i] - 1`` on the device
        (a draft model's forwards launched ahead, ``DraftModel.draft_ahead``).
        """
        if self.stager is not None and self.stager.fits(batch):
            return self._execute_staged(batch, input_patch, scatter, counts)
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_chunks: list[torch.Tensor] = []
        seqs: list[SeqAttention] = []
        logit_rows: list[int] = []
        spec = ([], [], [])  # device plans: slot, input row and logits row of x
        sampling = ([], [], [])  # and how each is verified: 1 / temperature, key, warp
        # launched ahead: the step in flight committed last_count[e] tokens, not one
        ahead = self.spec_step.last_count.tolist() if batch.spec_in_flight else None
        moved = (counts - 1).tolist() if counts is not None else None
        out = ForwardOutput(torch.empty(0))
        scored = []  # (request, first input row, count, first position) of prompt rows
        for i, (req, n) in enumerate(batch.items):
            start = req.num_computed_tokens
            q0 = len(input_ids)
            plan = req.draft if req.draft is not None and req.draft.num_tokens == n else None
            if ahead is not None and plan is not None and plan.device_slot is not None:
                start += ahead[len(spec[0])] - 1
            shift = moved[i] if moved is not None else 0  # its ids are patched (scatter)
            end = start + n
            key_slots = self.slots_of(req.block_table, torch.arange(end + shift))
            slot_chunks.append(key_slots[start + shift : end + shift])
            if plan is None:
                input_ids.extend(batch.input_ids(req, start, end))
                if batch.samples(req, end):
                    out.sample_rows[req] = len(logit_rows)
                    logit_rows.append(q0 + n - 1)
                lo, hi = batch.prompt_positions(req, start, end)
                if hi > lo:
                    scored.append((req, q0 + lo - start, hi - lo, lo))
                positions.append(torch.arange(start + shift, end + shift))
                seqs.append(SeqAttention(q0, n, end + shift, key_slots.to(self.device)))
            else:
                input_ids.extend(plan.token_ids)
                offs = plan.position_offsets
                positions.append(start + (offs if offs is not None else torch.arange(n)))
                seqs.append(SeqAttention(q0, n, end, key_slots.to(self.device),
                                         step_mask=plan.step_mask))
                out.draft_rows[req] = (len(logit_rows), n)
                if plan.device_slot is not None:
                    out.spec_entries[req] = len(spec[0])
                    for col, v in zip(spec + sampling, (plan.device_slot, q0, len(logit_rows),
                                                        plan.inv_temp, plan.key, plan.warp)):
                        col.append(v)
                logit_rows.extend(range(q0, q0 + n))
        for req, q, count, lo in scored:
            out.prompt_rows[req] = (len(logit_rows), count, lo)
            logit_rows.extend(range(q, q + count))
        dev = self.device
        meta = AttentionMetadata(torch.cat(slot_chunks).to(dev), seqs)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        if input_patch is not None:  # clamped: a failed row's INVALID_TOKEN (-1) stays valid
            ids[: len(input_patch)] = input_patch
            ids[: len(input_patch)].clamp_(min=0)
        if scatter is not None:
            ids[scatter[0]] = scatter[1]
        entries = (SpecEntries(*(to_device(col, torch.long, dev) for col in spec),
                               inv_temp=to_device(sampling[0], torch.float32, dev),
                               key=to_device(sampling[1], torch.long, dev),
                               warp=to_device(sampling[2], torch.float32, dev).view(-1, 3))
                   if out.spec_entries else None)
        proposal = self.spec_step.prologue(entries, ids) if entries is not None else None
        args = (ids, torch.cat(positions).to(dev), self.cache, meta,
                torch.tensor(logit_rows, dtype=torch.long, device=dev))
        out.logits = (self.leader.forward(*args, entries=entries) if self.leader is not None
                      else self.model.forward(*args))
        if entries is not None:
            out.spec = self.spec_step.epilogue(entries, proposal, out.logits,
                                               meta.slot_mapping, self.cache)
        return out

    def _execute_staged(self, batch: ScheduledBatch, input_patch: torch.Tensor | None = None,
                        scatter: tuple[torch.Tensor, torch.Tensor] | None = None,
                        counts: torch.Tensor | None = None) -> ForwardOutput:
        """The Triton path: numpy staging, one upload, then a graph replay or an eager forward."""
        stager = self.stager
        out = ForwardOutput(torch.empty(0))
        plans = stager.plans(batch)
        # device plans run in masked buckets, whose graphs hold their proposal and commit
        # (a prompt-lookup chain has no tree mask but needs them too)
        masked = any(p is not None and (p.step_mask is not None or p.device_slot is not None)
                     for p in plans)
        # logit rows at most: one per plain item, every token of a draft, and the prompt
        # positions scored (a step scoring a long prompt chunk runs eagerly: no bucket has
        # that many rows)
        rows = (sum(n if p is not None else 1 for (_, n), p in zip(batch.items, plans))
                + batch.num_prompt_rows())
        bucket = (self.graphs.find_bucket(len(batch.items), batch.num_tokens, masked, rows)
                  if self.graphs is not None else None)
        pad = (bucket.num_seqs, bucket.num_tokens) if bucket is not None else None
        st = stager.stage(batch, plans, out, pad)
        if input_patch is not None:  # after the upload, in stream order; clamped: a failed
            # row's INVALID_TOKEN (-1) must stay a valid embedding index (its output is dropped)
            ids = stager.d["input_ids"][: len(input_patch)]
            ids.copy_(input_patch)
            ids.clamp_(min=0)
        if scatter is not None:
            ids = stager.d["input_ids"]
            ids[scatter[0]] = scatter[1].to(ids.dtype)
        if counts is not None:
            n = batch.items[0][1]
            shift_rows(self.moved_entries(len(batch.items), n), stager.staged_rows(), counts,
                       n, self.device.type == "cuda")
        if self.leader is not None:  # the staged buffers as they are now, to every rank
            self.leader.send_staged(bucket, st, stager, len(out.spec_entries))
        out.logits, out.spec = self.forward_staged(bucket, st, len(out.spec_entries))
        stager.mark_consumed()  # the next step's upload may start once this forward has run
        return out

    def forward_staged(self, bucket, st, num_entries: int = 0):
        """The staged step's forward: bucket ``bucket``'s graph replay (None: eagerly, at
        the step's own sizes ``st``); (float32 logits [st.num_rows, vocab], the device
        plans' SpecOutput or None). ``num_entries``: device plans staged (a masked bucket's
        graph runs their steps too). A follower rank runs what rank 0 ran through here."""
        if bucket is not None:
            logits = self.graphs.replay(bucket, st.num_rows)
            return logits, self.graphs.spec_outputs[bucket] if num_entries else None
        stager, d, t = self.stager, self.stager.d, st.num_tokens
        meta = stager.metadata(st.num_seqs, t, st.max_query_len, st.max_context_len, st.masked,
                               st.single_rows)
        entries = stager.spec_entries(num_entries) if num_entries else None
        if entries is not None:
            proposal = self.spec_step.prologue(entries, d["input_ids"], stager.staged_rows())
        logits = self.model.forward(d["input_ids"][:t], d["positions"][:t], self.cache, meta,
                                    d["logit_rows"][: st.num_rows])
        spec = None
        if entries is not None:
            spec = self.spec_step.epilogue(entries, proposal, logits, meta.slot_mapping,
                                           self.cache)
        return logits, spec

    def moved_entries(self, num_seqs: int, n: int) -> SpecEntries:
        """``shift_rows``' entries for ``execute(counts=)``: sequence i's ``n`` rows from
        row i * n, all moved (cached per shape: no allocation per step)."""
        if (num_seqs, n) not in self._moved:
            seq = torch.arange(num_seqs, device=self.device)
            zero = torch.zeros_like(seq)
            self._moved[num_seqs, n] = SpecEntries(zero, seq * n, zero,
                                                   shift=torch.ones_like(seq), seq=seq)
        return self._moved[num_seqs, n]
