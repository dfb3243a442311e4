"""Step inputs for the Triton path: built in numpy on the host, copied to the device once.

One pinned int32 host buffer holds every per-step array (token ids, positions, cache slots,
logit rows, query start offsets, context lengths, mask offsets, block tables) at fixed
offsets, with a device twin of the same layout; a step fills the host side and issues one
non-blocking copy (plus one for the used part of the tree masks). Eager steps read exact-size
views of the device twin; CUDA graphs (kiln/runtime/cuda_graph.py) read bucket-size views of
the same buffers, so staging is shared and graph replays see each step's inputs.

Padding (graphs only, ``pad=(S, T)``): sequences ``b .. S-1`` are empty (query_len 0,
context 0) and sequence ``S`` takes the ``T - used`` leftover tokens with cache slots -1
(their KV write is skipped); nothing reads their outputs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from kiln.runtime.kv_cache import slot_of
from kiln.runtime.layers.triton_attention import TritonAttentionMetadata
from kiln.runtime.scheduler import ScheduledBatch
from kiln.runtime.speculative.device_step import StagedRows
from kiln.runtime.speculative.verify import SpecEntries
from kiln.runtime.speculative.draft import NO_WARP


@dataclass(frozen=True)
class Staged:
    """What ``StepStager.stage`` wrote (host-known sizes of the step)."""

    num_seqs: int
    num_tokens: int
    num_rows: int  # logits rows the caller needs (sample rows and draft rows)
    max_query_len: int
    max_context_len: int
    masked: bool
    mask_bytes: int = 0  # the used part of the tree masks (``mask_dev``)
    single_rows: int = 0  # sequences of one query (decodes)


class StepStager:
    """Pinned host buffers + their device twin for steps of at most ``max_seqs`` sequences
    (plus one padding sequence) and ``max_tokens`` tokens; see the module docstring."""

    def __init__(self, max_seqs: int, max_tokens: int, max_blocks: int, block_size: int,
                 max_mask: int, device: torch.device):
        self.max_seqs, self.max_tokens, self.max_blocks = max_seqs, max_tokens, max_blocks
        self.block_size = block_size
        self.device = device
        s1 = max_seqs + 1
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slots": max_tokens,
                 "logit_rows": max_tokens, "query_start_loc": s1 + 1, "context_lens": s1,
                 "mask_offsets": s1,
                 # device speculation entries (kiln/runtime/speculative/device_step.py):
                 # DeviceLookahead slot (-1: none), input row and logits row of the plan's x
                 "spec_slots": max_seqs, "spec_q0": max_seqs, "spec_r0": max_seqs,
                 # launched ahead: 1 = staged as if the step in flight committed one token;
                 # the plan's sequence index
                 "spec_shift": max_seqs, "spec_seq": max_seqs,
                 # how the plan is verified: float32 bits of 1 / temperature (0: greedy),
                 # its Philox key, float32 bits of its (top_k, top_p, min_p)
                 "spec_temp": max_seqs, "spec_key": max_seqs, "spec_warp": 3 * max_seqs,
                 # last: an upload copies the rows the step uses, not the whole table (a
                 # row spans max_seq_len: 8 MB for 257 rows of a 131k-token llama-3-8b)
                 "block_tables": s1 * max_blocks}
        pin = device.type == "cuda"
        self.host = torch.zeros(sum(sizes.values()), dtype=torch.int32, pin_memory=pin)
        self.dev = torch.zeros(sum(sizes.values()), dtype=torch.int32, device=device)
        np_all = self.host.numpy()
        self.h: dict[str, np.ndarray] = {}
        self.d: dict[str, torch.Tensor] = {}
        off = 0
        for name, n in sizes.items():
            self.h[name], self.d[name] = np_all[off : off + n], self.dev[off : off + n]
            off += n
        self._bt_offset = off - s1 * max_blocks
        self.h["block_tables"] = self.h["block_tables"].reshape(s1, max_blocks)
        self.spec_temp = self.h["spec_temp"].view(np.float32)
        self.spec_warp = self.h["spec_warp"].view(np.float32).reshape(max_seqs, 3)
        self.d["block_tables"] = self.d["block_tables"].view(s1, max_blocks)
        self.mask_host = torch.zeros(max(max_mask, 1), dtype=torch.uint8, pin_memory=pin)
        self.mask_dev = torch.zeros(max(max_mask, 1), dtype=torch.uint8, device=device)
        self.mask_np = self.mask_host.numpy()
        self._uploaded = torch.cuda.Event() if pin else None
        self._copy_stream = torch.cuda.Stream(device) if pin else None
        self._consumed = torch.cuda.Event() if pin else None
        self._consumed_marked = False  # since the last upload

    # -- transfer ----------------------------------------------------------------------------
    def mark_consumed(self) -> None:
        """Call right after enqueueing the forward that reads this step's staged inputs: the
        next upload may overwrite the device twin once that forward has run, without waiting
        for what the compute stream does after it (sampling). Without a mark since the last
        upload, the next one waits for the whole compute stream (always safe)."""
        if self._consumed is not None:
            self._consumed.record()
            self._consumed_marked = True

    def upload(self, mask_bytes: int = 0, table_rows: int | None = None) -> None:
        """Copy the host buffers to the device twin; the compute stream's later work waits
        for the copy. ``table_rows``: the block-table rows the step reads (None: all); the
        device keeps its older rows, which hold valid block ids."""
        # On CUDA the copy runs on a stream of its own, after the last forward that read the
        # device twin (``mark_consumed``) rather than after everything before it in the
        # compute stream: a decode step's copy (~7.5 us for an 8B engine at max batch 256)
        # then overlaps the previous step's sampling kernels instead of adding to the step.
        side = self._copy_stream is not None
        if side:
            compute = torch.cuda.current_stream(self.device)
            if self._consumed_marked:
                self._copy_stream.wait_event(self._consumed)
            else:
                self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream) if side else contextlib.nullcontext():
            n = (self.host.numel() if table_rows is None
                 else self._bt_offset + table_rows * self.max_blocks)
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            if mask_bytes:
                self.mask_dev[:mask_bytes].copy_(self.mask_host[:mask_bytes],
                                                 non_blocking=True)
            if self._uploaded is not None:
                self._uploaded.record()
        if side:
            compute.wait_event(self._uploaded)
        self._consumed_marked = False

    def wait_uploaded(self) -> None:
        """Host buffers may be rewritten only once the last copy out of them has run."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    # -- a step ------------------------------------------------------------------------------
    @staticmethod
    def plans(batch: ScheduledBatch) -> list:
        """Per item: the request's draft plan when this step runs it, else None."""
        return [r.draft if r.draft is not None and r.draft.num_tokens == n else None
                for r, n in batch.items]

    def fits(self, batch: ScheduledBatch) -> bool:
        return (len(batch.items) <= self.max_seqs and batch.num_tokens <= self.max_tokens
                and all(len(r.block_table) <= self.max_blocks for r, _ in batch.items))

    def stage(self, batch: ScheduledBatch, plans: list, out,
              pad: tuple[int, int] | None = None) -> Staged:
        """Write ``batch`` into the buffers and upload; fills ``out.sample_rows/draft_rows``
        (and ``spec_entries``, ``prompt_rows``).

        The caller checked ``fits(batch)``. ``pad=(S, T)`` lays the step out for a graph
        bucket of S sequences and T tokens (see the module docstring).
        """
        self.wait_uploaded()
        h = self.h
        bs = self.block_size
        ids, pos, slots, rows = h["input_ids"], h["positions"], h["slots"], h["logit_rows"]
        qsl, ctx, moff, bt = (h["query_start_loc"], h["context_lens"], h["mask_offsets"],
                              h["block_tables"])
        q0 = nrows = mask_used = max_q = max_ctx = singles = 0
        qsl[0] = 0
        spec_slots = h["spec_slots"]
        spec_slots[:] = -1
        scored = []  # (request, first input row, count, first position) of prompt rows
        for i, ((req, n), plan) in enumerate(zip(batch.items, plans)):
            start = req.num_computed_tokens
            end = start + n
            table = req.block_table
            bt[i, : len(table)] = table
            ctx[i] = end
            max_q, max_ctx = max(max_q, n), max(max_ctx, end)
            moff[i] = -1
            if req.prompt_logprobs is not None and plan is None:
                lo, hi = batch.prompt_positions(req, start, end)
                if hi > lo:
                    scored.append((req, q0 + lo - start, hi - lo, lo))
            if n == 1 and plan is None:  # decode: plain ints, no numpy temporaries
                singles += 1
                slots[q0] = slot_of(table, start, bs)
                known = req.all_token_ids
                ids[q0] = known[start] if start < len(known) else 0  # 0: in flight, patched
                pos[q0] = start
                if end >= len(known):  # its last known token, or its token in flight
                    out.sample_rows[req] = nrows
                    rows[nrows] = q0
                    nrows += 1
                q0 += 1
                qsl[i + 1] = q0
                continue
            idx = np.arange(start, end)
            slots[q0 : q0 + n] = bt[i, idx // bs] * bs + idx % bs
            if plan is None:
                ids[q0 : q0 + n] = batch.input_ids(req, start, end)
                pos[q0 : q0 + n] = idx
                if batch.samples(req, end):
                    out.sample_rows[req] = nrows
                    rows[nrows] = q0 + n - 1
                    nrows += 1
            else:
                ids[q0 : q0 + n] = plan.token_ids
                offs = plan.position_offsets
                pos[q0 : q0 + n] = start + (offs.numpy() if offs is not None else np.arange(n))
                if plan.step_mask is not None:  # else a chain: causal
                    moff[i] = mask_used
                    self.mask_np[mask_used : mask_used + n * n] = (
                        plan.step_mask.cpu().numpy().reshape(-1))
                    mask_used += n * n
                out.draft_rows[req] = (nrows, n)
                if plan.device_slot is not None:
                    e = len(out.spec_entries)
                    out.spec_entries[req] = e
                    spec_slots[e] = plan.device_slot
                    h["spec_q0"][e], h["spec_r0"][e] = q0, nrows
                    h["spec_seq"][e], h["spec_shift"][e] = i, batch.spec_in_flight
                    self.spec_temp[e], h["spec_key"][e] = plan.inv_temp, plan.key
                    self.spec_warp[e] = plan.warp
                rows[nrows : nrows + n] = np.arange(q0, q0 + n)
                nrows += n
            q0 += n
            qsl[i + 1] = q0
        for req, q, count, lo in scored:  # after every other row (ForwardOutput.prompt_rows)
            out.prompt_rows[req] = (nrows, count, lo)
            rows[nrows : nrows + count] = np.arange(q, q + count)
            nrows += count
        b = len(batch.items)
        if pad is not None:
            s, t = pad
            qsl[b + 1 : s + 1] = q0  # empty sequences
            ctx[b:s] = 0
            moff[b : s + 1] = -1
            qsl[s + 1] = t  # the padding sequence takes the leftover tokens
            ctx[s] = t - q0
            ids[q0:t] = 0
            pos[q0:t] = 0
            slots[q0:t] = -1
            rows[nrows:t] = 0
        self.upload(mask_used, (pad[0] if pad is not None else b) + 1)
        return Staged(b, q0, nrows, max_q, max_ctx, mask_used > 0, mask_used, singles)

    def metadata(self, num_seqs: int, num_tokens: int, max_query_len: int,
                 max_context_len: int, masked: bool,
                 single_rows: int | None = None) -> TritonAttentionMetadata:
        """Device views for ``num_seqs`` sequences (the padding one included, for graphs);
        ``single_rows``: how many have one query, when known (eager steps)."""
        d = self.d
        return TritonAttentionMetadata(
            block_tables=d["block_tables"][:num_seqs],
            query_start_loc=d["query_start_loc"][: num_seqs + 1],
            context_lens=d["context_lens"][:num_seqs], max_query_len=max_query_len,
            max_context_len=max_context_len,
            mask=self.mask_dev if masked else None,
            mask_offsets=d["mask_offsets"][:num_seqs] if masked else None,
            slot_mapping=d["slots"][:num_tokens], single_rows=single_rows,
        )

    def spec_entries(self, num: int) -> SpecEntries:
        """The device speculation entries of the staged step, ``num`` rows (device)."""
        d = self.d
        return SpecEntries(*(d[name][:num].long() for name in (
            "spec_slots", "spec_q0", "spec_r0", "spec_shift", "spec_seq")),
            inv_temp=d["spec_temp"][:num].view(torch.float32), key=d["spec_key"][:num].long(),
            warp=d["spec_warp"][: 3 * num].view(torch.float32).view(num, 3))

    def staged_rows(self) -> StagedRows:
        """The device inputs a plan staged ahead rewrites (``DeviceSpecStep.prologue``)."""
        d = self.d
        return StagedRows(d["positions"], d["slots"], d["context_lens"], d["block_tables"],
                          self.block_size)

    def fill_dummy(self, num_seqs: int, num_tokens: int) -> None:
        """A valid all-padding step of a graph bucket: no KV writes, nothing to read."""
        self.wait_uploaded()
        h = self.h
        for name in ("input_ids", "positions", "logit_rows", "context_lens"):
            h[name][:] = 0
        h["slots"][:] = -1
        h["mask_offsets"][:] = -1
        h["spec_slots"][:] = -1
        h["spec_temp"][:] = 0
        self.spec_warp[:] = NO_WARP
        h["query_start_loc"][:] = 0
        h["query_start_loc"][num_seqs + 1] = num_tokens
        h["context_lens"][num_seqs] = num_tokens
        h["block_tables"][:] = 0
        self.upload()
