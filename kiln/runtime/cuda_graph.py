"""CUDA graphs for small steps (decode, speculative, short chunks): the one owner of graph state.

A graph is captured per bucket ``(num_seqs S, num_tokens T, masked)``. It runs any batch of at
most S sequences and T tokens (tree masks only in masked buckets) because everything that
varies between steps lives in device buffers the graph reads: token ids, positions, cache
slots, block tables, query start offsets, context lengths, tree masks and logit rows, all
staged by kiln/runtime/staging.py (one pinned buffer, one non-blocking copy per step).

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

With device speculation (``spec_step``, kiln/runtime/speculative/device_step.py) a masked
bucket's graph also runs, around its forward, the proposal of every device plan (written
into the input ids), the greedy verification, the state update and the KV move of accepted
rows, for one entry per sequence of the bucket (the stager's spec buffers; entries without
a plan do nothing). What it committed is read from ``spec_outputs[bucket]``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from kiln.runtime.kv_cache import KVCache
from kiln.runtime.models.llama import LlamaModel
from kiln.runtime.staging import StepStager

_SMALL_SEQ_BUCKETS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Bucket:
    num_seqs: int
    num_tokens: int
    masked: bool
    # the launch config's hint (1 for decode buckets), not a bound: find_bucket also places
    # short prefills here (any step of at most num_seqs sequences and num_tokens tokens)
    max_query_len: int
    # logit rows the graph computes: every token's in decode (T == S) and masked buckets,
    # one per sequence in prefill buckets (a step's rows: one per sequence that finishes its
    # prompt or decodes, all of a draft's tokens)
    num_rows: int

    @property
    def prefill(self) -> bool:
        """A prefill bucket: unmasked, more tokens than sequences."""
        return not self.masked and self.num_tokens > self.num_seqs


def seq_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (which is always included)."""
    out = [s for s in _SMALL_SEQ_BUCKETS if s < max_num_seqs]
    out += list(range(16, max_num_seqs, 16))
    return sorted(set(out + [max_num_seqs]))


# The smallest prefill bucket. Up to a few hundred tokens a step's GEMMs cost what reading
# the weights costs, so padding a short prompt to 128 tokens is free, and engines with small
# batches do not capture a ladder of tiny buckets (2, 4, 8, ... tokens).
PREFILL_MIN_TOKENS = 128


def prefill_tokens(max_decode_tokens: int, limit: int) -> list[int]:
    """Token counts of the prefill buckets: powers of two past the largest decode bucket (at
    least ``PREFILL_MIN_TOKENS``), then ``limit`` itself (the engine's token budget or
    ``max_graph_tokens``)."""
    out, t = [], max(PREFILL_MIN_TOKENS, 1 << max(max_decode_tokens, 1).bit_length())
    while t < limit:
        out.append(t)
        t *= 2
    return out + [limit] if limit > max_decode_tokens else out


def plan_buckets(max_num_seqs: int, max_num_tokens: int, tokens_per_step: int,
                 max_graph_tokens: int, max_spec_seqs: int = 8,
                 prefill: bool = True) -> list[Bucket]:
    """Decode buckets (T == S, causal); prefill buckets (S = the engine's sequences, T past the
    largest decode bucket up to the token budget and ``max_graph_tokens``: a prompt, or a
    prompt chunk with the running decodes, one logit row per sequence); and, for speculative
    engines, masked buckets with T = S * tokens_per_step (capped likewise).

    Without prefill buckets every prompt longer than the largest decode bucket (64 tokens at
    the default batch size) ran eagerly: one Python launch per kernel, host-bound
    (smollm2-135m, 128-token prompt: TTFT 29 ms).
    """
    limit = min(max_num_tokens, max_graph_tokens)
    buckets = [Bucket(s, s, False, 1, s) for s in seq_buckets(max_num_seqs)
               if s <= max_num_tokens]
    top = max((b.num_tokens for b in buckets), default=0)
    if prefill:
        buckets += [Bucket(max_num_seqs, t, False, t, max_num_seqs)
                    for t in prefill_tokens(top, limit)]
    if tokens_per_step > 1:
        for s in seq_buckets(min(max_num_seqs, max_spec_seqs)):
            t = s * tokens_per_step
            if t <= limit:
                buckets.append(Bucket(s, t, True, tokens_per_step, t))
    return buckets


class CudaGraphRunner:
    """Captures and replays the model's forward for small steps; see the module docstring.

    Inputs come from the model runner's ``StepStager`` (shared buffers: the graphs read the
    same device memory every step). ``find_bucket`` picks the smallest captured bucket a
    batch fits; ``replay`` returns the float32 logits rows the staging asked for.
    """

    def __init__(self, model: LlamaModel, cache: KVCache, stager: StepStager,
                 max_num_seqs: int, max_num_tokens: int, tokens_per_step: int,
                 max_graph_tokens: int = 1024, prefill: bool = True, spec_step=None):
        self.model = model
        self.spec_step = spec_step
        self.cache = cache
        self.stager = stager
        self.device = stager.device
        cap = stager.max_blocks * stager.block_size
        self.max_context_len = cap
        self.buckets = [b for b in plan_buckets(max_num_seqs, max_num_tokens, tokens_per_step,
                                                min(max_graph_tokens, cap), prefill=prefill)
                        if b.num_seqs <= stager.max_seqs and b.num_tokens <= stager.max_tokens]
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Bucket, torch.Tensor] = {}
        self.spec_outputs: dict[Bucket, object] = {}  # masked buckets: SpecOutput
        self.pool = None
        self.ready: set[Bucket] = set()  # buckets that can run (captured, or eager off CUDA)
        self.failed: dict[Bucket, str] = {}  # buckets whose capture raised -> the error
        self.capture_s = 0.0
        self.replays: dict[Bucket, int] = {}  # replays per bucket

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    # -- capture -----------------------------------------------------------------------------
    def _forward(self, b: Bucket) -> torch.Tensor:
        d = self.stager.d
        t = b.num_tokens
        # launch bounds from the bucket (the padding sequence is the extra one)
        meta = self.stager.metadata(b.num_seqs + 1, t, b.max_query_len, self.max_context_len,
                                    b.masked)
        spec = self.spec_step if b.masked else None
        if spec is not None:
            entries = self.stager.spec_entries(b.num_seqs)
            proposal = spec.prologue(entries, d["input_ids"], self.stager.staged_rows())
        logits = self.model.forward(d["input_ids"][:t], d["positions"][:t], self.cache, meta,
                                    d["logit_rows"][: b.num_rows])
        if spec is not None:
            self.spec_outputs[b] = spec.epilogue(entries, proposal, logits, meta.slot_mapping,
                                                 self.cache)
        return logits

    def capture(self, progress=None, strict: bool = False) -> float:
        """Capture every bucket (largest first, one shared memory pool; the decode and masked
        buckets before the prefill ones, so that running out of memory on a large prefill
        bucket never costs a decode graph); returns seconds.

        Off CUDA (tests under TRITON_INTERPRET) nothing is captured: ``replay`` runs the
        same static-buffer forward eagerly, so the staging logic is tested everywhere.
        ``strict``: a failed capture raises (RuntimeError naming the bucket) instead.
        """
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            self.pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, key=lambda b: (not b.prefill, b.num_tokens, b.num_seqs),
                        reverse=True):
            try:
                self._capture_one(b, stream)
            except Exception as e:
                self.failed[b] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if strict:
                    raise RuntimeError(
                        f"CUDA graph capture of the {b.num_seqs} seqs x {b.num_tokens} tokens "
                        f"bucket failed ({self.failed[b]}); set KILN_PREFILL_GRAPHS=0 (decode graphs "
                        "only) or KILN_CUDA_GRAPHS=0 (none)") from e
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    # smaller buckets would fail the same way; keep what was captured (the
                    # decode and masked buckets come first: a prefill bucket that runs out
                    # costs none of them)
                    break
            if progress is not None:
                progress()
        if cuda:
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        return self.capture_s

    def _capture_one(self, b: Bucket, stream: torch.cuda.Stream | None) -> None:
        if stream is None:  # off CUDA: nothing to capture, replay runs the forward eagerly
            self.ready.add(b)
            return
        self.stager.fill_dummy(b.num_seqs, b.num_tokens)
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

    def replay_ms(self, b: Bucket, iters: int = 5) -> float:
        """Median GPU time of a captured bucket's replay on dummy inputs (CUDA events)."""
        self.stager.fill_dummy(b.num_seqs, b.num_tokens)
        graph = self.graphs[b]
        graph.replay()  # warm
        times = []
        for _ in range(iters):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    # -- a step ------------------------------------------------------------------------------
    def find_bucket(self, num_seqs: int, num_tokens: int, masked: bool,
                    num_rows: int | None = None) -> Bucket | None:
        """The smallest ready bucket for a step of ``num_seqs`` sequences, ``num_tokens``
        tokens and at most ``num_rows`` logit rows (None: one per token)."""
        rows = num_tokens if num_rows is None else num_rows
        fits = [b for b in self.buckets
                if b.num_seqs >= num_seqs and b.num_tokens >= num_tokens
                and b.num_rows >= rows and (b.masked or not masked) and b in self.ready]
        return min(fits, key=lambda b: (b.num_tokens, b.masked, b.num_seqs), default=None)

    def replay(self, b: Bucket, num_rows: int) -> torch.Tensor:
        """Run bucket ``b`` over the staged inputs; float32 logits [num_rows, vocab]."""
        self.replays[b] = self.replays.get(b, 0) + 1
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:num_rows].clone()
        graph.replay()
        return self.outputs[b][:num_rows].clone()


def report_capture_failures(runner) -> None:
    """One stderr line when some CUDA graph buckets could not be captured (those steps run
    eagerly, same results); graphs are dropped altogether when none was captured."""
    graphs = runner.graphs
    if not graphs.failed:
        return
    first = next(iter(graphs.failed.items()))
    print(f"warning: {len(graphs.failed)} of {len(graphs.buckets)} CUDA graph buckets could not "
          f"be captured and run eagerly (first: {first[0].num_seqs} seqs x "
          f"{first[0].num_tokens} tokens: {first[1]}); set KILN_CUDA_GRAPHS=0 to skip capture",
          file=sys.stderr, flush=True)
    if not graphs.ready:
        runner.graphs = None
