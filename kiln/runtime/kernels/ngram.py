"""Prompt-lookup (ngram) speculative decoding's per-step state logic as two Triton kernels.

``DeviceNgram`` (kiln/runtime/speculative/device_ngram.py) keeps each request slot's tokens
in a device history and runs a step as batched torch ops (``find_drafts`` alone is a dozen
ops per match length over the whole history). These kernels do the same work with one
program per request of the batch, two launches per step:

    tokens, lens = ngram_propose(state, slots, input_ids, q0)  # = state.propose(slots)
    ... forward; argmax of every row [B, T] ...
    verdict = ngram_commit(state, slots, tokens, lens, argmax)  # = state.verify(...) then
                                                                #   state.update(...)

The torch ops are the reference: tests/unit/test_ngram_kernels.py runs both side by side
(TRITON_INTERPRET) and compares every output and the history after each step.

The draft search in one pass over the history: for every position e < n (the token that
would follow a match), ``ml(e)`` is how many tokens before e equal the history's last ones
(up to max_match). ``find_draft`` takes the longest k >= min_match that matches anywhere,
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
from kiln.runtime.speculative.device_lookahead import StepVerdict
from kiln.runtime.speculative.device_ngram import DeviceNgram

_BLOCK = 256  # history positions per iteration of the draft search


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
    follow = tl.where(top >= 0, top % C, n)  # e of the winning match; none: past the text
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


def _check_state(state: DeviceNgram, slots: torch.Tensor) -> None:
    dev = state.history.device
    check_tensor("state.history", state.history, ndim=2, dtypes=(torch.int32,), device=dev)
    check_tensor("state.length", state.length, ndim=1, dtypes=(torch.int64,), device=dev)
    for name in ("history", "length"):
        if not getattr(state, name).is_contiguous():
            raise ValueError(f"state.{name} must be contiguous")
    check_tensor("slots", slots, ndim=1, dtypes=(torch.int64,), device=dev)


def ngram_propose(state: DeviceNgram, slots: torch.Tensor,
                  input_ids: torch.Tensor | None = None, q0: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``state.propose(slots)`` in one launch: the step's input ids [B, T] (long: x, the
    draft, 0 past it) and the drafts' lengths [B] (long). ``slots`` [B] long, distinct but
    for -1 (no request: its rows are left unwritten). With ``input_ids`` (a step's flat token
    ids, int32/int64) and ``q0`` [B] long, entry b's T tokens are also written to
    ``input_ids[q0[b] : q0[b] + T]``."""
    _check_state(state, slots)
    b, dev = slots.shape[0], state.history.device
    t = state.num_tokens
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
            slots, state.history, state.length, tokens, lens,
            input_ids if input_ids is not None else tokens, q0 if q0 is not None else slots,
            state.capacity, MAXM=state.max_match, MINM=state.min_match, D=state.max_draft_len,
            T_PAD=next_pow2(t), BLOCK=_BLOCK, WRITE_IDS=input_ids is not None, num_warps=4,
            **_pdl.launch_kwargs(),
        )
    return tokens, lens


def ngram_commit(state: DeviceNgram, slots: torch.Tensor, tokens: torch.Tensor,
                 draft_lens: torch.Tensor, argmax: torch.Tensor) -> StepVerdict:
    """``state.verify(tokens, argmax, draft_lens)`` then ``state.update(...)`` in one launch:
    ``tokens`` [B, T] long and ``draft_lens`` [B] long from the proposal, ``argmax`` [B, T]
    int64/int32 (the model's greedy token after each row). Returns the verdict (committed
    [B, T], count [B]; no KV moves); the histories move on in place. An entry of slot -1
    commits nothing: its count is 0, its committed row unwritten."""
    _check_state(state, slots)
    dev = state.history.device
    b, t = slots.shape[0], state.num_tokens
    check_tensor("tokens", tokens, ndim=2, dtypes=(torch.int64,), device=dev)
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
            slots, tokens, draft_lens, argmax, state.history, state.length, committed, count,
            argmax.stride(0), state.capacity, D=state.max_draft_len, T_PAD=next_pow2(t),
            num_warps=1, **_pdl.launch_kwargs(),
        )
    return StepVerdict(committed, count, None)
