"""Prompt-lookup (ngram) speculative decoding's per-step state logic as two Triton kernels.

``DeviceNgram`` (kiln/runtime/speculative/device_ngram.py) keeps each request slot's tokens
in a device history and runs a step as batched torch ops (``find_drafts`` alone is a dozen
ops per match length over the whole history). These kernels do the same work with one
program per request of the batch, two launches per step, on the state's tensors (``history``
[S, C] int32, ``length`` [S] long), which they read and write in place:

    tokens, lens = ngram_propose(history, length, slots, max_match=.., min_match=..,
                                 max_draft_len=.., input_ids=.., q0=..)  # = state.propose
    ... forward; argmax of every row [B, T] ...
    committed, count = ngram_commit(history, length, slots, tokens, lens, argmax)
                                                  # = state.verify(...) then state.update(...)

The torch ops are the reference: tests/unit/test_ngram_kernels.py runs both side by side
(TRITON_INTERPRET) and compares every output and the history after each step.

The draft search in one pass over the history: for every position e < n (the token that
would follow a match), ``ml(e)`` is how many tokens before e equal the history's last ones
(up to max_match). The draft follows the longest k >= min_match that matches anywhere,
at its latest place: the largest (ml(e), e) with ml(e) >= min_match. The loop runs over the
request's own length only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import check_shape, check_tensor, next_pow2
from kiln.runtime.kernels._pdl import pdl_begin

BLOCK = 256  # history positions per iteration of the draft search


@triton.jit
def lookup_follow(hist, n, C, MAXM: tl.constexpr, MINM: tl.constexpr, BLOCK: tl.constexpr):
    """Where prompt lookup's draft starts in one slot's history ``hist`` of ``n``
    tokens (row stride ``C``): the e of the longest, then latest, match; ``n`` when none
    (the draft is empty). Shared by prompt lookup and lookahead's prompt-lookup candidate."""
    best = tl.full([BLOCK], -1, dtype=tl.int64)  # per lane: the largest ml(e) * C + e
    for start in range(0, n, BLOCK):
        e = start + tl.arange(0, BLOCK).to(tl.int64)
        live = e < n
        ml = tl.zeros([BLOCK], dtype=tl.int64)  # matched so far; i + 1 while still running
        for i in tl.static_range(MAXM):
            # e - 1 - i >= 0 implies n - 1 - i >= 0 (e < n): the suffix token exists
            ok = live & (e - 1 - i >= 0) & (ml == i)
            t = tl.load(hist + e - 1 - i, mask=ok, other=0)
            s = tl.load(hist + tl.maximum(n - 1 - i, 0))  # i > n - 1: ``ok`` is False
            ml += (ok & (t == s)).to(tl.int64)
        score = tl.where((e < n) & (ml >= MINM), ml * C + e, -1)
        best = tl.maximum(best, score)
    top = tl.max(best, axis=0)
    return tl.where(top >= 0, top % C, n)  # e of the winning match; none: past the text


@triton.jit
def _ngram_propose_kernel(
    slots_ptr, hist_ptr, len_ptr, tokens_ptr, lens_ptr, ids_ptr, q0_ptr, C,
    MAXM: tl.constexpr, MINM: tl.constexpr, D: tl.constexpr, T_PAD: tl.constexpr,
    BLOCK: tl.constexpr, WRITE_IDS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    T: tl.constexpr = D + 1
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    if slot < 0:  # no request at this entry (a graph bucket's spare one): nothing to write
        return
    n = tl.load(len_ptr + slot)
    hist = hist_ptr + slot * C
    follow = lookup_follow(hist, n, C, MAXM, MINM, BLOCK)
    j = tl.arange(0, T_PAD).to(tl.int64)
    pos = follow + j - 1  # row j >= 1 holds draft token j - 1
    real = (j >= 1) & (j < T) & (pos < n)
    draft = tl.load(hist + pos, mask=real, other=0).to(tl.int64)
    x = tl.load(hist + n - 1).to(tl.int64)
    row = tl.where(j == 0, x, draft)
    tl.store(tokens_ptr + b * T + j, row, mask=j < T)
    tl.store(lens_ptr + b, tl.sum(real.to(tl.int64), axis=0))
    if WRITE_IDS:  # entry b's rows of the step's input ids
        ids = ids_ptr + tl.load(q0_ptr + b)
        tl.store(ids + j, row.to(ids_ptr.dtype.element_ty), mask=j < T)


@triton.jit
def _ngram_commit_kernel(
    slots_ptr, tokens_ptr, lens_ptr, argmax_ptr, hist_ptr, len_ptr, committed_ptr, count_ptr,
    stride_argmax, C, D: tl.constexpr, T_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    T: tl.constexpr = D + 1
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    if slot < 0:
        tl.store(count_ptr + b, 0)
        return
    j = tl.arange(0, T_PAD).to(tl.int64)
    am = tl.load(argmax_ptr + b * stride_argmax + j, mask=j < T, other=0).to(tl.int64)
    draft = tl.load(tokens_ptr + b * T + 1 + j, mask=j < D, other=0)
    lens = tl.load(lens_ptr + b)
    miss = (j < D) & ((am != draft) | (j >= lens))
    m = tl.min(tl.where(miss, j, D), axis=0)  # drafts matched: the first miss, or all D
    keep = j <= m
    tl.store(committed_ptr + b * T + j, tl.where(keep, am, 0), mask=j < T)
    tl.store(count_ptr + b, m + 1)
    n = tl.load(len_ptr + slot)
    hist = hist_ptr + slot * C
    tl.store(hist + n + j, am.to(hist_ptr.dtype.element_ty), mask=keep & (n + j < C))
    tl.store(len_ptr + slot, n + m + 1)


def _check_history(history: torch.Tensor, length: torch.Tensor, slots: torch.Tensor) -> None:
    dev = history.device
    check_tensor("history", history, ndim=2, dtypes=(torch.int32,), device=dev)
    check_tensor("length", length, ndim=1, dtypes=(torch.int64,), device=dev)
    for name, t in (("history", history), ("length", length)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_tensor("slots", slots, ndim=1, dtypes=(torch.int64,), device=dev)


def ngram_propose(history: torch.Tensor, length: torch.Tensor, slots: torch.Tensor, *,
                  max_match: int, min_match: int, max_draft_len: int,
                  input_ids: torch.Tensor | None = None, q0: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``DeviceNgram.propose(slots)`` in one launch. ``history`` [S, C] int32 (each slot's
    tokens) and ``length`` [S] long (how many are real) are the slots' state; ``slots`` [B]
    long, distinct but for -1 (no request: its rows are left unwritten). Returns the step's
    input ids [B, T] (long: x, the draft, 0 past it; T = 1 + max_draft_len) and the drafts'
    lengths [B] (long). With ``input_ids`` (a step's flat token ids, int32/int64) and ``q0``
    [B] long, entry b's T tokens are also written to ``input_ids[q0[b] : q0[b] + T]``."""
    _check_history(history, length, slots)
    b, dev = slots.shape[0], history.device
    t = 1 + max_draft_len
    tokens = torch.empty(b, t, dtype=torch.long, device=dev)
    lens = torch.empty(b, dtype=torch.long, device=dev)
    if (input_ids is None) != (q0 is None):
        raise ValueError("input_ids and q0 go together: pass both or neither")
    if input_ids is not None:
        check_tensor("input_ids", input_ids, ndim=1, dtypes=(torch.int32, torch.int64),
                     device=dev)
        check_tensor("q0", q0, ndim=1, dtypes=(torch.int64,), device=dev)
        check_shape("q0", q0, (b,))
    if b:
        _ngram_propose_kernel[(b,)](
            slots, history, length, tokens, lens,
            input_ids if input_ids is not None else tokens, q0 if q0 is not None else slots,
            history.shape[1], MAXM=max_match, MINM=min_match, D=max_draft_len,
            T_PAD=next_pow2(t), BLOCK=BLOCK, WRITE_IDS=input_ids is not None, num_warps=4,
            **_pdl.launch_kwargs(),
        )
    return tokens, lens


def ngram_commit(history: torch.Tensor, length: torch.Tensor, slots: torch.Tensor,
                 tokens: torch.Tensor, draft_lens: torch.Tensor, argmax: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``DeviceNgram.verify(tokens, argmax, draft_lens)`` then ``.update(...)`` in one
    launch: ``tokens`` [B, T] long and ``draft_lens`` [B] long from the proposal, ``argmax``
    [B, T] int64/int32 (the model's target token after each row). Returns (committed [B, T],
    count [B]); a chain moves no KV. ``history`` and ``length`` (``ngram_propose``) move on
    in place. An entry of slot -1 commits nothing: its count is 0, its committed row
    unwritten."""
    _check_history(history, length, slots)
    dev = history.device
    check_tensor("tokens", tokens, ndim=2, dtypes=(torch.int64,), device=dev)
    b, t = slots.shape[0], tokens.shape[1]
    check_tensor("draft_lens", draft_lens, ndim=1, dtypes=(torch.int64,), device=dev)
    check_tensor("argmax", argmax, ndim=2, dtypes=(torch.int64, torch.int32), device=dev)
    check_shape("tokens", tokens, (b, t))
    check_shape("draft_lens", draft_lens, (b,))
    check_shape("argmax", argmax, (b, t))
    if not tokens.is_contiguous():
        raise ValueError("tokens must be contiguous")
    committed = torch.empty(b, t, dtype=torch.long, device=dev)
    count = torch.empty(b, dtype=torch.long, device=dev)
    if b:
        _ngram_commit_kernel[(b,)](
            slots, tokens, draft_lens, argmax, history, length, committed, count,
            argmax.stride(0), history.shape[1], D=t - 1, T_PAD=next_pow2(t),
            num_warps=1, **_pdl.launch_kwargs(),
        )
    return committed, count
