"""CUDA graphs for small steps (decode, speculative, short chunks): the one owner of graph state.

A graph is captured per bucket ``(num_seqs S, num_tokens T, masked)``. It runs any batch of at
most S sequences and T tokens (tree masks only in masked buckets) because everything that
varies between steps lives in device buffers the graph reads: token ids, positions, cache
slots, block tables, query start offsets, context lengths, tree masks and logit rows. The
host fills one pinned int32 staging buffer per step and copies it with one non-blocking copy.

Layout of a bucket's batch (S + 1 sequences, T tokens):

    seq 0 .. b-1     the batch's requests, in batch order, their real query lengths
    seq b .. S-1     empty (query_len 0, context 0): the attention kernel skips them
    seq S            the padding sequence: the T - used leftover tokens, causal over its own
                     (never written) keys, cache slots -1 (the KV write skips them)

Padding rows compute garbage that nothing reads: no real sequence can see them (they are
another sequence), and their logits rows are never returned. Kernel launch parameters that
would depend on the batch (the key-split count, the query tile) are fixed per bucket from
its upper bounds (T, the block-table capacity), so the captured grid is valid for any batch
that fits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.triton_attention import TritonAttentionMetadata
from kiln.runtime.models.llama import LlamaModel
from kiln.runtime.scheduler import ScheduledBatch

_SMALL_SEQ_BUCKETS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Bucket:
    num_seqs: int
    num_tokens: int
    masked: bool
    max_query_len: int


def seq_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (which is always included)."""
    out = [s for s in _SMALL_SEQ_BUCKETS if s < max_num_seqs]
    out += list(range(16, max_num_seqs, 16))
    return sorted(set(out + [max_num_seqs]))


def plan_buckets(max_num_seqs: int, max_num_tokens: int, tokens_per_step: int,
                 max_graph_tokens: int, max_spec_seqs: int = 8) -> list[Bucket]:
    """Decode buckets (T == S, causal) and, for speculative engines, masked buckets with
    T = S * tokens_per_step (capped by the engine's token budget and ``max_graph_tokens``)."""
    buckets = [Bucket(s, s, False, 1) for s in seq_buckets(max_num_seqs)
               if s <= max_num_tokens]
    if tokens_per_step > 1:
        for s in seq_buckets(min(max_num_seqs, max_spec_seqs)):
            t = s * tokens_per_step
            if t <= min(max_num_tokens, max_graph_tokens):
                buckets.append(Bucket(s, t, True, tokens_per_step))
    return buckets


class StepInputs:
    """Host-side staging of one step (numpy views of a pinned int32 buffer) and its device twin.

    Sections (int32): input_ids [T], positions [T], slots [T], logit_rows [T],
    query_start_loc [S + 2], context_lens [S + 1], mask_offsets [S + 1],
    block_tables [(S + 1) * max_blocks]. Masks: uint8 [S * P * P] (P = tokens per step).
    """

    def __init__(self, max_seqs: int, max_tokens: int, max_blocks: int, max_mask: int,
                 device: torch.device):
        self.max_seqs, self.max_tokens, self.max_blocks = max_seqs, max_tokens, max_blocks
        s1 = max_seqs + 1
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slots": max_tokens,
                 "logit_rows": max_tokens, "query_start_loc": s1 + 1, "context_lens": s1,
                 "mask_offsets": s1, "block_tables": s1 * max_blocks}
        total = sum(sizes.values())
        pin = device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self.dev = torch.zeros(total, dtype=torch.int32, device=device)
        self.np = self.host.numpy()
        self.host_view: dict[str, np.ndarray] = {}
        self.dev_view: dict[str, torch.Tensor] = {}
        off = 0
        for name, n in sizes.items():
            self.host_view[name] = self.np[off : off + n]
            self.dev_view[name] = self.dev[off : off + n]
            off += n
        self.host_view["block_tables"] = self.host_view["block_tables"].reshape(s1, max_blocks)
        self.dev_view["block_tables"] = self.dev_view["block_tables"].view(s1, max_blocks)
        self.mask_host = torch.zeros(max(max_mask, 1), dtype=torch.uint8, pin_memory=pin)
        self.mask_dev = torch.zeros(max(max_mask, 1), dtype=torch.uint8, device=device)
        self.mask_np = self.mask_host.numpy()

        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def upload(self, with_mask: bool) -> None:
        self.dev.copy_(self.host, non_blocking=True)
        if with_mask:
            self.mask_dev.copy_(self.mask_host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def wait_uploaded(self) -> None:
        """The host buffers may be rewritten only once the last copy out of them is done."""
        if self._uploaded is not None:
            self._uploaded.synchronize()


class CudaGraphRunner:
    """Captures and replays the model's forward for small steps; see the module docstring.

    ``prepare(batch)`` returns a bucket when the batch fits one (else the caller runs eager);
    ``replay(bucket)`` then returns float32 logits [T, vocab] (a fresh tensor) of which the
    rows ``logit_rows`` were filled for the caller's bookkeeping.
    """

    def __init__(self, model: LlamaModel, cache: KVCache, max_num_seqs: int,
                 max_num_tokens: int, max_seq_len: int, tokens_per_step: int,
                 device: torch.device, max_graph_tokens: int = 1024):
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        # room for a full request plus one speculative step
        self.max_blocks = -(-(max_seq_len + tokens_per_step) // self.block_size)
        self.buckets = plan_buckets(max_num_seqs, max_num_tokens, tokens_per_step,
                                    min(max_graph_tokens, self.max_blocks * self.block_size))
        self.tokens_per_step = tokens_per_step
        max_seqs = max(b.num_seqs for b in self.buckets)
        max_tokens = max(b.num_tokens for b in self.buckets)
        masked = [b for b in self.buckets if b.masked]
        max_mask = max((b.num_seqs * tokens_per_step ** 2 for b in masked), default=0)
        self.inputs = StepInputs(max_seqs, max_tokens, self.max_blocks, max_mask, device)
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Bucket, torch.Tensor] = {}
        self.pool = None
        self.ready: set[Bucket] = set()  # buckets that can run (captured, or eager off CUDA)
        self.capture_s = 0.0
        self.num_replays = 0

    # -- capture -----------------------------------------------------------------------------
    def _meta(self, b: Bucket) -> TritonAttentionMetadata:
        v = self.inputs.dev_view
        s1 = b.num_seqs + 1
        cap = self.max_blocks * self.block_size
        return TritonAttentionMetadata(
            block_tables=v["block_tables"][:s1], query_start_loc=v["query_start_loc"][: s1 + 1],
            context_lens=v["context_lens"][:s1], max_query_len=b.max_query_len,
            max_context_len=cap,
            mask=self.inputs.mask_dev[: b.num_seqs * self.tokens_per_step ** 2] if b.masked
            else None,
            mask_offsets=v["mask_offsets"][:s1] if b.masked else None,
            slot_mapping=v["slots"][: b.num_tokens],
        )

    def _forward(self, b: Bucket) -> torch.Tensor:
        v = self.inputs.dev_view
        t = b.num_tokens
        return self.model.forward(v["input_ids"][:t], v["positions"][:t], self.cache,
                                  self._meta(b), v["logit_rows"][:t])

    def _fill_dummy(self, b: Bucket) -> None:
        """A valid all-padding step: every token in the padding sequence, no writes."""
        h = self.inputs.host_view
        for name in ("input_ids", "positions", "logit_rows", "context_lens", "mask_offsets"):
            h[name][:] = 0
        h["slots"][:] = -1
        h["mask_offsets"][:] = -1
        h["query_start_loc"][:] = 0
        h["query_start_loc"][b.num_seqs + 1] = b.num_tokens
        h["context_lens"][b.num_seqs] = b.num_tokens
        h["block_tables"][:] = 0
        self.inputs.upload(with_mask=b.masked)

    def capture(self, progress=None) -> float:
        """Capture every bucket (largest first, one shared memory pool); returns seconds.

        Off CUDA (tests under TRITON_INTERPRET) nothing is captured: ``replay`` runs the
        same static-buffer forward eagerly, so the staging logic is tested everywhere.
        """
        t0 = time.perf_counter()
        if self.device.type != "cuda":
            self.ready = set(self.buckets)
            return 0.0
        stream = torch.cuda.Stream(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, key=lambda b: (b.num_tokens, b.num_seqs), reverse=True):
            self._fill_dummy(b)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the kernels, settle the allocator
                    self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
            self.ready.add(b)
            if progress is not None:
                progress()
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        return self.capture_s

    # -- a step ------------------------------------------------------------------------------
    def find_bucket(self, num_seqs: int, num_tokens: int, masked: bool) -> Bucket | None:
        fits = [b for b in self.buckets
                if b.num_seqs >= num_seqs and b.num_tokens >= num_tokens
                and (b.masked or not masked) and b in self.ready]
        return min(fits, key=lambda b: (b.num_tokens, b.masked, b.num_seqs), default=None)

    def prepare(self, batch: ScheduledBatch, out) -> Bucket | None:
        """Stage ``batch`` into the input buffers; fills ``out.sample_rows / draft_rows``.

        Returns None (and stages nothing) when no captured bucket fits the batch.
        """
        items = batch.items
        plans = []
        for req, n in items:
            d = req.draft
            plans.append(d if d is not None and d.num_tokens == n else None)
        masked = any(p is not None for p in plans)
        total = batch.num_tokens
        b = self.find_bucket(len(items), total, masked)
        if b is None:
            return None
        self.inputs.wait_uploaded()
        h = self.inputs.host_view
        bs = self.block_size
        ids, pos, slots, rows = h["input_ids"], h["positions"], h["slots"], h["logit_rows"]
        qsl, ctx, moff, bt = (h["query_start_loc"], h["context_lens"], h["mask_offsets"],
                              h["block_tables"])
        pp = self.tokens_per_step ** 2
        q0 = 0
        nrows = 0
        qsl[0] = 0
        for i, ((req, n), plan) in enumerate(zip(items, plans)):
            start = req.num_computed_tokens
            end = start + n
            table = req.block_table
            if len(table) > self.max_blocks:
                return None
            bt[i, : len(table)] = table
            idx = np.arange(start, end)
            slots[q0 : q0 + n] = bt[i, idx // bs] * bs + idx % bs
            ctx[i] = end
            if plan is None:
                ids[q0 : q0 + n] = req.all_token_ids[start:end]
                pos[q0 : q0 + n] = idx
                moff[i] = -1
                if end == req.num_tokens:
                    out.sample_rows[req] = nrows
                    rows[nrows] = q0 + n - 1
                    nrows += 1
            else:
                ids[q0 : q0 + n] = plan.token_ids
                offs = plan.position_offsets
                pos[q0 : q0 + n] = start + (offs.numpy() if offs is not None else np.arange(n))
                if plan.step_mask is None:  # a chain: causal
                    moff[i] = -1
                else:
                    moff[i] = i * pp
                    self.inputs.mask_np[i * pp : i * pp + n * n] = (
                        plan.step_mask.cpu().numpy().reshape(-1))
                out.draft_rows[req] = (nrows, n)
                rows[nrows : nrows + n] = np.arange(q0, q0 + n)
                nrows += n
            q0 += n
            qsl[i + 1] = q0
        s = b.num_seqs
        qsl[len(items) + 1 : s + 1] = q0  # empty sequences
        ctx[len(items) : s] = 0
        moff[len(items) : s + 1] = -1
        qsl[s + 1] = b.num_tokens  # the padding sequence takes the leftover tokens
        ctx[s] = b.num_tokens - q0
        ids[q0 : b.num_tokens] = 0
        pos[q0 : b.num_tokens] = 0
        slots[q0 : b.num_tokens] = -1
        rows[nrows : b.num_tokens] = 0
        self.inputs.upload(with_mask=masked)
        self._rows = nrows
        return b

    def replay(self, b: Bucket) -> torch.Tensor:
        """Run bucket ``b`` over the staged inputs; float32 logits of the staged rows."""
        self.num_replays += 1
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[: self._rows].clone()
        graph.replay()
        return self.outputs[b][: self._rows].clone()
