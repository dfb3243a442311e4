"""Lookahead speculative decoding's per-step state logic as two Triton kernels.

``DeviceLookahead`` (kiln/runtime/speculative/device_lookahead.py) keeps each request slot's
Jacobi window, n-gram pool, last tokens and token count in device tensors and runs a step
as batched torch ops: ``propose``, ``verify`` and ``update`` (whose ``_insert`` loop alone
is about a dozen ops per inserted n-gram). These kernels do the same work with one program
per request of the batch, two launches per step:

    tokens, valid = lookahead_propose(slots, window, keys, conts, cursor, recent, total,
                                      history, g, match)   # = state.propose(slots)
    ... forward; argmax of every row [B, T] ...
    committed, count, src_rows = lookahead_commit(slots, tokens, argmax, valid, window, keys,
                                                  conts, cursor, recent, total, history,
                                                  window_rows, last_rows, cand_rows)
                                      # = state.verify(...) then state.update(...)

They take the state's tensors (the shapes: ``DeviceLookahead``'s docstring; all int64,
contiguous; the history int32), read and write them in place (window, keys, conts, cursor,
recent, total, history) and
return bit-identical results: the torch ops of device_lookahead.py are the reference, and
tests/unit/test_lookahead_kernels.py runs both side by side (TRITON_INTERPRET) and compares
every output and every state tensor after each step.

``valid`` (which candidate slots hold a real candidate: the pool's entries of x,
compacted to the front, and the prompt-lookup candidate, ``with_lookup``) goes from the
proposal to the commit. The prompt-lookup draft is found in the slot's token ``history``
[S, C] int32 (``total`` tokens) with prompt lookup's search (``kernels.ngram.lookup_follow``);
the commit and the fold append the committed tokens to it.

Per commit program, in ``update``'s order: verification (longest matching valid candidate,
first on ties, its matched tokens plus the bonus) from the pool as it was; then the W
lookahead n-grams and the N committed n-grams, inserted one after another with
``NgramPool.add``'s semantics (a barrier after each, so the next one reads its writes);
then ``recent``, ``total`` and the window shift. In-step rows come from the state's layout
tensors (window_rows, last_rows, cand_rows); the proposal writes the same layout (x, the
window, the candidates: lookahead_math's module docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import check_shape, check_tensor, next_pow2
from kiln.runtime.kernels._pdl import pdl_begin
from kiln.runtime.kernels.ngram import BLOCK, lookup_follow

INDEX_DTYPES = (torch.int64,)


@triton.jit
def _pymod(a, m):
    """``a % m`` with Python's (torch's) sign: the result is in [0, m) for m > 0."""
    r = a % m
    return tl.where(r < 0, r + m, r)


@triton.jit
def _committed_at(k, ok, m, best, bonus, tok, crows_ptr, N1: tl.constexpr):
    """committed[k] (0 past the bonus): candidate ``best``'s token k for k < m, the bonus
    at k == m; ``ok`` masks lanes that are not read."""
    take = ok & (k >= 0) & (k < m)
    row = tl.load(crows_ptr + best * N1 + k, mask=take, other=0)
    t = tl.load(tok + row, mask=take, other=0)
    return tl.where(take, t, tl.where(k == m, bonus, 0))


@triton.jit
def _seq_at(i, ok, rec, m, best, bonus, tok, crows_ptr, N1: tl.constexpr):
    """seq[i] of ``update``: the old recent tokens [N-1] then committed [N]."""
    old = tl.load(rec + i, mask=ok & (i < N1), other=0)
    k = i - N1  # committed[k], as _committed_at (inlined: the interpreter pays per call)
    take = ok & (k >= 0) & (k < m)
    row = tl.load(crows_ptr + best * N1 + k, mask=take, other=0)
    new = tl.where(take, tl.load(tok + row, mask=take, other=0), tl.where(k == m, bonus, 0))
    return tl.where(i < N1, old, new)


@triton.jit
def _insert_one(keys_ptr, conts_ptr, cursor_ptr, slot, key, cont, ok, H, GM,
                G: tl.constexpr, N1: tl.constexpr, G_PAD: tl.constexpr, N1_PAD: tl.constexpr):
    """``NgramPool.add`` of (key, cont [N1_PAD]) where ``ok``: nothing when the bucket holds
    the same entry, else write it at the bucket's cursor and advance the cursor."""
    h = key % H
    bucket = slot * H + tl.where(h < 0, h + H, h)  # _pymod, inlined
    i = tl.arange(0, G_PAD)
    c = tl.arange(0, N1_PAD)
    gm = i < G
    cm = c < N1
    bkeys = tl.load(keys_ptr + bucket * GM + i, mask=gm, other=0)
    bconts = tl.load(conts_ptr + (bucket * GM + i)[:, None] * N1 + c[None, :],
                     mask=gm[:, None] & cm[None, :], other=0)
    diff = tl.sum(tl.where(cm[None, :] & (bconts != cont[None, :]), 1, 0), axis=1)
    ndup = tl.sum(tl.where(gm & (bkeys == key) & (diff == 0), 1, 0), axis=0)
    write = ok & (ndup == 0)
    cur = tl.load(cursor_ptr + bucket)
    tl.store(keys_ptr + bucket * GM + cur, key, mask=write)
    # write as a block: TRITON_INTERPRET mistypes a broadcast scalar comparison of an int64
    # (a bool flagged int64: "mask has unsupported dtype")
    write_c = (c * 0 + tl.where(write, 1, 0)) > 0
    tl.store(conts_ptr + (bucket * GM + cur) * N1 + c, cont, mask=write_c & cm)
    tl.store(cursor_ptr + bucket, (cur + 1) % G, mask=write)


@triton.jit
def _lookahead_propose_kernel(
    slots_ptr, window_ptr, keys_ptr, conts_ptr, cursor_ptr, recent_ptr, tokens_ptr, valid_ptr,
    ids_ptr, q0_ptr, hist_ptr, total_ptr, H, GM, C,
    W: tl.constexpr, N: tl.constexpr, G: tl.constexpr, WL_PAD: tl.constexpr,
    G_PAD: tl.constexpr, N1_PAD: tl.constexpr, MAXM: tl.constexpr, MINM: tl.constexpr,
    BLOCK: tl.constexpr, WRITE_IDS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    N1: tl.constexpr = N - 1
    CB: tl.constexpr = W * N1  # x and the window: rows 0 .. W(N-1)-1; candidates after
    T: tl.constexpr = (W + G) * N1
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    if slot < 0:  # no request at this entry (a graph bucket's spare one): nothing to write
        return
    x = tl.load(recent_ptr + slot * N1 + (N1 - 1))
    tok = tokens_ptr + b * T
    ids = ids_ptr
    if WRITE_IDS:  # entry b's rows of the step's input ids
        ids = ids_ptr + tl.load(q0_ptr + b)
    # row l*W + j is (level l, col j): the window flattened, level 0 col 0 replaced by x
    r = tl.arange(0, WL_PAD)
    rm = r < CB
    win = tl.load(window_ptr + slot * CB + r, mask=rm, other=0)
    first = tl.where(r == 0, x, win)
    tl.store(tok + r, first, mask=rm)
    if WRITE_IDS:
        tl.store(ids + r, first.to(ids_ptr.dtype.element_ty), mask=rm)
    if G > 0:
        h = _pymod(x, H)
        bucket = slot * H + h
        cur = tl.load(cursor_ptr + bucket)
        i = tl.arange(0, G_PAD)
        c = tl.arange(0, N1_PAD)
        gm = i < G
        cm = c < N1
        order = _pymod(cur - 1 - i, G)  # most recent first
        keys = tl.load(keys_ptr + bucket * GM + order, mask=gm, other=0)
        hit = gm & (keys == x)
        nhit = tl.sum(tl.where(hit, 1, 0), axis=0)
        # stable compaction: hit i goes to the number of hits before it
        dest = tl.sum(tl.where(hit[None, :] & (i[None, :] < i[:, None]), 1, 0), axis=1)
        hm = hit[:, None] & cm[None, :]
        conts = tl.load(conts_ptr + (bucket * GM + order)[:, None] * N1 + c[None, :],
                        mask=hm, other=0)
        # the prompt-lookup candidate (``with_lookup``): the draft after the latest earlier
        # match of the slot's last tokens, 0 past its end, in slot min(nhit, G-1) unless it
        # is empty or one of the hits
        n = tl.load(total_ptr + slot)
        follow = lookup_follow(hist_ptr + slot * C, n, C, MAXM, MINM, BLOCK)
        dpos = follow + c
        real = cm & (dpos < n)
        draft = tl.load(hist_ptr + slot * C + dpos, mask=real, other=0).to(tl.int64)
        differs = tl.sum(tl.where(cm[None, :] & (conts != draft[None, :]), 1, 0), axis=1)
        ndup = tl.sum(tl.where(hit & (differs == 0), 1, 0), axis=0)
        # masks as blocks: TRITON_INTERPRET mistypes a scalar bool broadcast into a mask
        use = tl.where((tl.sum(real.to(tl.int32), axis=0) > 0) & (ndup == 0), 1, 0)
        at = tl.minimum(nhit, G - 1)
        over = (i == at) & ((i * 0 + use) > 0)  # the slot the lookup candidate takes
        hm = hm & ~((dest == at) & ((dest * 0 + use) > 0))[:, None]
        tl.store(tok + CB + dest[:, None] * N1 + c[None, :], conts, mask=hm)
        pad = (gm & (i >= nhit) & ~over)[:, None] & cm[None, :]
        fill = tl.zeros([G_PAD, N1_PAD], dtype=tl.int64) + x
        tl.store(tok + CB + i[:, None] * N1 + c[None, :], fill, mask=pad)
        lm = cm & ((c * 0 + use) > 0)
        tl.store(tok + CB + at * N1 + c, draft, mask=lm)
        if WRITE_IDS:
            el = ids_ptr.dtype.element_ty
            tl.store(ids + CB + dest[:, None] * N1 + c[None, :], conts.to(el), mask=hm)
            tl.store(ids + CB + i[:, None] * N1 + c[None, :], fill.to(el), mask=pad)
            tl.store(ids + CB + at * N1 + c, draft.to(el), mask=lm)
        tl.store(valid_ptr + b * G + i, (i < nhit) | over, mask=gm)


@triton.jit
def _lookahead_commit_kernel(
    slots_ptr, tokens_ptr, argmax_ptr, valid_ptr, window_ptr, keys_ptr, conts_ptr, cursor_ptr,
    recent_ptr, total_ptr, hist_ptr, wrows_ptr, lrows_ptr, crows_ptr, committed_ptr, count_ptr,
    src_ptr, stride_tok, stride_am, H, GM, C,
    W: tl.constexpr, N: tl.constexpr, G: tl.constexpr, WL_PAD: tl.constexpr,
    G_PAD: tl.constexpr, N_PAD: tl.constexpr, N1_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    N1: tl.constexpr = N - 1
    CB: tl.constexpr = W * N1
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    if slot < 0:  # no request at this entry: it commits nothing (the KV move skips it)
        tl.store(count_ptr + b, (slot * 0).to(tl.int64))
        return
    tok = tokens_ptr + b * stride_tok
    am = argmax_ptr + b * stride_am
    rec = recent_ptr + slot * N1
    x_next = tl.load(am).to(tl.int64)
    c = tl.arange(0, N1_PAD)
    cm = c < N1

    # -- verify (greedy) the candidates the proposal marked valid ---------------------------
    if G > 0:
        i = tl.arange(0, G_PAD)
        gm = i < G
        valid = tl.load(valid_ptr + b * G + i, mask=gm, other=0) != 0
        m2 = gm[:, None] & cm[None, :]
        prev = m2 & (c[None, :] > 0)
        crow = crows_ptr + i[:, None] * N1 + c[None, :]
        cand = tl.load(tok + tl.load(crow, mask=m2, other=0), mask=m2, other=0)
        after_prev = tl.load(am + tl.load(crow - 1, mask=prev, other=0), mask=prev, other=0)
        target = tl.where(c[None, :] == 0, x_next, after_prev.to(tl.int64))
        match = (cand == target) & valid[:, None]
        mlen = tl.min(tl.where(cm[None, :] & (match == 0), c[None, :], N1), axis=1)
        mlen = tl.where(gm, mlen, -1)
        m = tl.max(mlen, axis=0)
        best = tl.min(tl.where(mlen == m, i, G_PAD), axis=0)  # first of the longest
        has = m > 0
        bonus_row = tl.load(crows_ptr + best * N1 + m - 1, mask=has, other=0)
        bonus = tl.where(has, tl.load(am + bonus_row, mask=has, other=0).to(tl.int64), x_next)
        src = tl.load(crows_ptr + best * N1 + c, mask=cm, other=0)
    else:
        m = (x_next * 0).to(tl.int32)
        best = m
        bonus = x_next
        src = tl.zeros([N1_PAD], dtype=tl.int64)
    k = tl.arange(0, N_PAD)
    committed = _committed_at(k, k < N, m, best, bonus, tok, crows_ptr, N1)
    tl.store(committed_ptr + b * N + k, committed, mask=k < N)
    tl.store(count_ptr + b, (m + 1).to(tl.int64))
    tl.store(src_ptr + b * N1 + c, src, mask=cm)

    # -- inserts, in update()'s order: W lookahead n-grams, then N committed n-grams --------
    if G > 0:
        tl.debug_barrier()  # verification read the bucket before any insert writes it
        yes = tl.full([], 1, dtype=tl.int1)
        for e in tl.static_range(W + N):
            if e < W:
                # column e's chain (levels 0 .. N-2) and the last level's output token
                key = tl.load(tok + tl.load(wrows_ptr + e))
                up = cm & (c + 1 < N1)
                wrow = tl.load(wrows_ptr + (c + 1) * W + e, mask=up, other=0)
                new = tl.load(am + tl.load(lrows_ptr + e)).to(tl.int64)
                cont = tl.where(c + 1 < N1, tl.load(tok + wrow, mask=up, other=0), new)
                ok = yes
            else:
                # n-gram ending at committed token e - W: seq[e-W .. e-W+N-1]
                ce = e - W
                first = _seq_at(ce + c, c == 0, rec, m, best, bonus, tok, crows_ptr, N1)
                key = tl.sum(tl.where(c == 0, first, 0), axis=0)
                cont = _seq_at(ce + 1 + c, cm, rec, m, best, bonus, tok, crows_ptr, N1)
                neg = tl.sum(tl.where(cm & (cont < 0), 1, 0), axis=0)
                ok = (ce < m + 1) & (key >= 0) & (neg == 0)
            _insert_one(keys_ptr, conts_ptr, cursor_ptr, slot, key, cont, ok, H, GM,
                        G, N1, G_PAD, N1_PAD)
            tl.debug_barrier()  # the next insert reads this one's writes

    # -- recent, total, window shift --------------------------------------------------------
    recent = _seq_at(m + 1 + c, cm, rec, m, best, bonus, tok, crows_ptr, N1)
    r = tl.arange(0, WL_PAD)
    rm = r < CB
    lower = rm & (r + W < CB)  # level l < N-2 takes level l+1
    wptr = window_ptr + slot * CB + r
    up_win = tl.load(wptr + W, mask=lower, other=0)
    last = tl.load(am + tl.load(lrows_ptr + r % W, mask=rm, other=0), mask=rm, other=0)
    shifted = tl.where(lower, up_win, last.to(tl.int64))
    shifted = tl.where(r == 0, 0, shifted)  # level 0 col 0 is x, refreshed at proposal
    total = tl.load(total_ptr + slot)
    tl.debug_barrier()  # every read of the old recent and window is done
    tl.store(rec + c, recent, mask=cm)
    tl.store(total_ptr + slot, total + (m + 1).to(tl.int64))
    tl.store(wptr, shifted, mask=rm)
    at = total + k  # the committed tokens join the history
    tl.store(hist_ptr + slot * C + at, committed.to(hist_ptr.dtype.element_ty),
             mask=(k <= m) & (at < C))


# the tokens' row stride is the width of the batch's pending tokens, which varies call to
# call: never a specialisation (width 1, a multiple of 16 and the rest each compiled a
# variant mid-serving, a 0.5-1.9 s stall of the engine thread)
@triton.jit(do_not_specialize=["stride_tok"])
def _lookahead_fold_kernel(
    slots_ptr, tokens_ptr, count_ptr, keys_ptr, conts_ptr, cursor_ptr, recent_ptr, total_ptr,
    hist_ptr, stride_tok, H, GM, C,
    N: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, N1_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    N1: tl.constexpr = N - 1
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    k_new = tl.load(count_ptr + b)
    if (slot < 0) | (k_new <= 0):
        return
    tok = tokens_ptr + b * stride_tok
    rec = recent_ptr + slot * N1
    c = tl.arange(0, N1_PAD)
    cm = c < N1
    # seq = recent [N-1] then the K tokens; the n-gram ending at token e is seq[e .. e+N-1]
    if G > 0:
        for e in range(0, k_new):
            i = e + 1 + c  # the continuation's indices in seq
            old = tl.load(rec + i, mask=cm & (i < N1), other=0)
            new = tl.load(tok + i - N1, mask=cm & (i >= N1), other=0)
            cont = tl.where(i < N1, old, new)
            key_old = tl.load(rec + e, mask=e < N1, other=0)
            key_new = tl.load(tok + e - N1, mask=e >= N1, other=0)
            key = tl.where(e < N1, key_old, key_new)
            neg = tl.sum(tl.where(cm & (cont < 0), 1, 0), axis=0)
            _insert_one(keys_ptr, conts_ptr, cursor_ptr, slot, key, cont,
                        (key >= 0) & (neg == 0), H, GM, G, N1, G_PAD, N1_PAD)
            tl.debug_barrier()  # the next insert reads this one's writes
    i = k_new + c  # the new recent tokens: seq[K .. K+N-2]
    old = tl.load(rec + i, mask=cm & (i < N1), other=0)
    new = tl.load(tok + i - N1, mask=cm & (i >= N1), other=0)
    recent = tl.where(i < N1, old, new)
    total = tl.load(total_ptr + slot)
    tl.debug_barrier()  # every read of the old recent tokens is done
    tl.store(rec + c, recent, mask=cm)
    tl.store(total_ptr + slot, total + k_new)
    for k0 in range(0, k_new, 16):  # the tokens join the history
        k = k0 + tl.arange(0, 16)
        km = (k < k_new) & (total + k < C)
        t = tl.load(tok + k, mask=km, other=0)
        tl.store(hist_ptr + slot * C + total + k, t.to(hist_ptr.dtype.element_ty), mask=km)


def lookahead_fold(slots: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor,
                   keys: torch.Tensor, conts: torch.Tensor, cursor: torch.Tensor,
                   recent: torch.Tensor, total: torch.Tensor, history: torch.Tensor,
                   g: int) -> None:
    """``DeviceLookahead.commit_tokens(slots, tokens, count)`` in one launch: the tokens plain
    steps committed (``tokens[b, :count[b]]``, [B, K] long) join the slots' pools (``keys``,
    ``conts``, ``cursor``), recent tokens, totals and histories, written in place (``g``:
    G). The torch ops run a dozen launches per token (``_insert``); a paced request that
    decoded plainly for a while folds dozens of tokens at its next proposal."""
    _check_state(slots, keys=keys, conts=conts, cursor=cursor, recent=recent, total=total)
    _check_history(history, keys.device)
    dev = keys.device
    b = slots.shape[0]
    check_tensor("tokens", tokens, ndim=2, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("count", count, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_shape("tokens", tokens, (b, None))
    check_shape("count", count, (b,))
    if b:
        n = recent.shape[1] + 1
        _lookahead_fold_kernel[(b,)](
            slots, tokens, count, keys, conts, cursor, recent, total, history,
            tokens.stride(0), keys.shape[1], keys.shape[2], history.shape[1], N=n, G=g,
            G_PAD=next_pow2(max(g, 1)), N1_PAD=next_pow2(n - 1), num_warps=1,
            **_pdl.launch_kwargs(),
        )


def _check_state(slots: torch.Tensor, **state: torch.Tensor) -> None:
    """The state tensors (int64, contiguous, one device) and ``slots`` [B] long."""
    dev = next(iter(state.values())).device
    for name, t in state.items():
        check_tensor(name, t, dtypes=INDEX_DTYPES, device=dev)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_tensor("slots", slots, ndim=1, dtypes=INDEX_DTYPES, device=dev)


def _check_history(history: torch.Tensor, dev: torch.device) -> None:
    """A state's token history [S, C] int32, contiguous (the prompt-lookup candidate's text)."""
    check_tensor("history", history, ndim=2, dtypes=(torch.int32,), device=dev)
    if not history.is_contiguous():
        raise ValueError("history must be contiguous")


def _pads(window: torch.Tensor, g: int) -> dict:
    """The window's (W, N) from ``window`` [S, N-1, W], G, and their padded sizes."""
    w, n = window.shape[2], window.shape[1] + 1
    return {"W": w, "N": n, "G": g, "WL_PAD": next_pow2(w * (n - 1)),
            "G_PAD": next_pow2(max(g, 1)), "N1_PAD": next_pow2(n - 1)}


def lookahead_propose(slots: torch.Tensor, window: torch.Tensor, keys: torch.Tensor,
                      conts: torch.Tensor, cursor: torch.Tensor, recent: torch.Tensor,
                      total: torch.Tensor, history: torch.Tensor, g: int,
                      match: tuple[int, int], input_ids: torch.Tensor | None = None,
                      q0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``DeviceLookahead.propose(slots)`` in one launch, from the slots' window, pool
    (``keys``, ``conts``, ``cursor``), recent tokens and token history (``total`` tokens of
    ``history``, searched for the prompt-lookup candidate with n-grams of ``match`` =
    (longest, shortest) tokens; ``g``: G candidates). Returns the step's input ids [B, T]
    (long; T = (W + G)(N - 1)) and which candidate slots hold a real candidate [B, G]
    (bool). ``slots`` [B] long, distinct but for -1 (no request: its rows are left
    unwritten). With ``input_ids`` (a step's flat token ids, int32/int64) and ``q0`` [B]
    long, entry b's T tokens are also written to ``input_ids[q0[b] : q0[b] + T]``."""
    _check_state(slots, window=window, keys=keys, conts=conts, cursor=cursor, recent=recent,
                 total=total)
    _check_history(history, window.device)
    b, dev = slots.shape[0], window.device
    pads = _pads(window, g)
    t = (pads["W"] + g) * (pads["N"] - 1)
    tokens = torch.empty(b, t, dtype=torch.long, device=dev)
    valid = torch.empty(b, g, dtype=torch.bool, device=dev)
    if (input_ids is None) != (q0 is None):
        raise ValueError("input_ids and q0 go together: pass both or neither")
    if input_ids is not None:
        check_tensor("input_ids", input_ids, ndim=1, dtypes=(torch.int32, torch.int64),
                     device=dev)
        check_tensor("q0", q0, ndim=1, dtypes=INDEX_DTYPES, device=dev)
        check_shape("q0", q0, (b,))
    if b:
        _lookahead_propose_kernel[(b,)](
            slots, window, keys, conts, cursor, recent, tokens,
            valid if g else tokens,  # no candidate columns: never touched
            input_ids if input_ids is not None else tokens, q0 if q0 is not None else slots,
            history, total, keys.shape[1], keys.shape[2], history.shape[1],
            MAXM=match[0], MINM=match[1], BLOCK=BLOCK, WRITE_IDS=input_ids is not None,
            **pads, num_warps=4, **_pdl.launch_kwargs(),
        )
    return tokens, valid


def lookahead_commit(slots: torch.Tensor, tokens: torch.Tensor, argmax: torch.Tensor,
                     valid: torch.Tensor, window: torch.Tensor, keys: torch.Tensor,
                     conts: torch.Tensor, cursor: torch.Tensor, recent: torch.Tensor,
                     total: torch.Tensor, history: torch.Tensor, window_rows: torch.Tensor,
                     last_rows: torch.Tensor, cand_rows: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DeviceLookahead.verify(tokens, argmax, valid)`` then ``.update(slots, tokens,
    argmax, verdict)`` in one launch: ``tokens`` [B, T] long and ``valid`` [B, G] bool from
    the proposal, ``argmax`` [B, T] int64/int32 (the model's target token after each row).
    The step layout's rows: ``window_rows`` [N-1, W], ``last_rows`` [W], ``cand_rows``
    [G, N-1]. Returns the verdict's tensors (``StepVerdict``'s committed [B, N], count [B],
    src_rows [B, N-1]); the state (window, pool, recent, total, history) is updated in
    place. An entry of slot -1 commits nothing: its count is 0, its other outputs unwritten."""
    _check_state(slots, window=window, keys=keys, conts=conts, cursor=cursor, recent=recent,
                 total=total)
    dev = window.device
    _check_history(history, dev)
    g = cand_rows.shape[0]
    pads = _pads(window, g)
    n = pads["N"]
    b, t = slots.shape[0], (pads["W"] + g) * (n - 1)
    check_tensor("tokens", tokens, ndim=2, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("argmax", argmax, ndim=2, dtypes=(torch.int64, torch.int32), device=dev)
    check_shape("tokens", tokens, (b, t))
    check_shape("argmax", argmax, (b, t))
    if g:
        check_tensor("valid", valid, ndim=2, dtypes=(torch.bool,), device=dev)
        check_shape("valid", valid, (b, g))
        if not valid.is_contiguous():
            raise ValueError("valid must be contiguous")
    committed = torch.empty(b, n, dtype=torch.long, device=dev)
    count = torch.empty(b, dtype=torch.long, device=dev)
    src_rows = torch.empty(b, n - 1, dtype=torch.long, device=dev)
    if b:
        rows = (window_rows, last_rows, cand_rows if g else last_rows)  # g == 0: never read
        for name, r in zip(("window_rows", "last_rows", "cand_rows"), rows):
            check_tensor(name, r, dtypes=INDEX_DTYPES, device=dev)
            if not r.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        _lookahead_commit_kernel[(b,)](
            slots, tokens, argmax, valid if g else slots, window, keys, conts, cursor, recent,
            total, history, *rows, committed, count, src_rows, tokens.stride(0),
            argmax.stride(0), keys.shape[1], keys.shape[2], history.shape[1],
            N_PAD=next_pow2(n), **pads, num_warps=1, **_pdl.launch_kwargs(),
        )
    return committed, count, src_rows


@triton.jit
def _move_kv_kernel(
    k_ptr, v_ptr, sm_ptr, q0_ptr, count_ptr, src_ptr, stride_layer, stride_b, stride_s,
    stride_h, BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, E_PAD: tl.constexpr,
    N1: tl.constexpr, N1_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    moves = tl.load(count_ptr + b) - 1  # accepted drafts; the bonus token has no KV yet
    if moves <= 0:
        return
    cache = k_ptr + layer * stride_layer
    if tl.program_id(2) == 1:
        cache = v_ptr + layer * stride_layer
    q = tl.load(q0_ptr + b)
    k = tl.arange(0, N1_PAD)
    km = k < moves
    src = tl.load(sm_ptr + q + tl.load(src_ptr + b * N1 + k, mask=km, other=0), mask=km,
                  other=0).to(tl.int64)
    dst = tl.load(sm_ptr + q + 1 + k, mask=km, other=0).to(tl.int64)
    e = tl.arange(0, E_PAD)  # (head, dim) of a slot
    e_off = (e // D) * stride_h + e % D
    m = km[:, None] & (e < H * D)[None, :]
    src_off = (src // BS) * stride_b + (src % BS) * stride_s
    dst_off = (dst // BS) * stride_b + (dst % BS) * stride_s
    rows = tl.load(cache + src_off[:, None] + e_off[None, :], mask=m)
    tl.debug_barrier()  # a source may be another move's destination: every read first
    tl.store(cache + dst_off[:, None] + e_off[None, :], rows, mask=m)


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def lookahead_move_kv(k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, q0: torch.Tensor, count: torch.Tensor,
                      src_rows: torch.Tensor) -> None:
    """Keep the accepted rows' KV (one launch, every layer): for entry b with ``count[b] = c``
    (a verdict's count [B] and src_rows [B, N-1]), the KV written at input row
    ``q0[b] + src_rows[b, k]`` moves to row ``q0[b] + 1 + k`` (x's index + 1 + k) for
    k < c - 1; ``slot_mapping`` [num_tokens] (int32/int64) is the cache slot of each input
    row of the step. Entries of count 0 or 1 move nothing. Caches [layers, num_blocks,
    block_size, kv_heads, head_dim] of any dtype and either KV layout (``KVCache``: strided,
    head_dim contiguous)."""
    dev = k_cache.device
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=dev)
    check_tensor("q0", q0, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("count", count, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("src_rows", src_rows, ndim=2, dtypes=INDEX_DTYPES, device=dev)
    b, n1 = src_rows.shape
    if not (k_cache.dim() == 5 and k_cache.stride(-1) == 1
            and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
            and k_cache.dtype == v_cache.dtype):
        raise ValueError("k_cache and v_cache must be [layers, num_blocks, block_size, "
                         "kv_heads, head_dim] of one dtype and one layout, head_dim contiguous")
    if not b:
        return
    raw = _RAW[k_cache.element_size()]
    layers, _, bs, heads, dim = k_cache.shape
    kc, vc = k_cache.view(raw), v_cache.view(raw)
    _move_kv_kernel[(b, layers, 2)](
        kc, vc, slot_mapping, q0, count, src_rows.contiguous(),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3), BS=bs, H=heads, D=dim,
        E_PAD=next_pow2(heads * dim), N1=n1, N1_PAD=next_pow2(max(n1, 1)),
        num_warps=4, **_pdl.launch_kwargs(),
    )


@triton.jit
def _shift_rows_kernel(
    shift_ptr, slots_ptr, seq_ptr, q0_ptr, count_ptr, pos_ptr, cache_slots_ptr, ctx_ptr,
    bt_ptr, stride_bt, BS: tl.constexpr, T: tl.constexpr, T_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    e = tl.program_id(0).to(tl.int64)
    delta = tl.load(count_ptr + e) - 1
    if (tl.load(shift_ptr + e) <= 0) | (tl.load(slots_ptr + e) < 0) | (delta == 0):
        return
    q = tl.load(q0_ptr + e)
    seq = tl.load(seq_ptr + e)
    t = tl.arange(0, T_PAD)
    m = t < T
    # row t writes its KV at token index x + t (x: row 0's position), not at its position
    # (a tree's rows share positions): the new cache slots come from the shifted index
    idx = tl.load(pos_ptr + q).to(tl.int64) + delta + t
    pos = tl.load(pos_ptr + q + t, mask=m, other=0).to(tl.int64) + delta
    blk = tl.load(bt_ptr + seq * stride_bt + idx // BS, mask=m, other=0).to(tl.int64)
    tl.debug_barrier()  # row 0's position is read before it is rewritten
    tl.store(pos_ptr + q + t, pos.to(pos_ptr.dtype.element_ty), mask=m)
    tl.store(cache_slots_ptr + q + t, (blk * BS + idx % BS).to(cache_slots_ptr.dtype.element_ty),
             mask=m)
    ctx = tl.load(ctx_ptr + seq)
    tl.store(ctx_ptr + seq, (ctx + delta).to(ctx_ptr.dtype.element_ty))


def shift_staged_rows(shift: torch.Tensor, slots: torch.Tensor, seq: torch.Tensor,
                      q0: torch.Tensor, last_count: torch.Tensor, positions: torch.Tensor,
                      cache_slots: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, block_size: int, num_tokens: int) -> None:
    """``device_step.shift_rows`` in one launch (kiln/runtime/speculative/device_step.py):
    each entry e [B] staged ahead (``shift[e]`` > 0, ``slots[e]`` >= 0; its sequence
    ``seq[e]``, its first input row ``q0[e]``) moves its ``num_tokens`` staged
    ``positions``, ``cache_slots`` (those of token indices x + t, t the row, in
    ``block_tables`` [num_seqs, M] of blocks of ``block_size``) and ``context_lens`` on by
    ``last_count[e] - 1``, in place."""
    b = slots.shape[0]
    if not b:
        return
    _shift_rows_kernel[(b,)](
        shift, slots, seq, q0, last_count, positions, cache_slots, context_lens,
        block_tables, block_tables.stride(0), BS=block_size, T=num_tokens,
        T_PAD=next_pow2(num_tokens), num_warps=1, **_pdl.launch_kwargs(),
    )
