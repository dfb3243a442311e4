"""Paged attention over the block table for mixed batches (prefill chunks, decode, drafts).

Sequence ``s`` owns queries ``query_start_loc[s] : query_start_loc[s + 1]`` of the flat
batch (query_len = their count) and keys 0 .. context_lens[s] - 1 of its block table; the
last query_len keys are the step's own tokens. Prefix keys are always visible; the in-step
part is causal, or follows the sequence's tree mask when ``mask_offsets[s] >= 0``:
``mask[mask_offsets[s] + i * query_len + j]`` (uint8/bool, 1 = query i may see in-step key
j). Everything stays on the device: no loop over sequences on the host.

Kernel layout (flash-decoding with GQA packing): a program owns BLOCK_Q queries of one
sequence times the QPK query heads of one kv head (BLOCK_M = BLOCK_Q * QPK rows, so each K/V
tile is read once per group) and one of ``num_splits`` slices of the keys. Online softmax
in float32 (exp2, scale folded in). With more than one split (``MULTI``) each program writes an
unnormalised partial (acc, max, sum) and ``_reduce_kernel`` merges them.

What a launch may vary without compiling a new kernel variant: the sequence count and the
split count are plain runtime arguments, never specialised (an eager prefill's split count
follows its length: as compile-time constants, the first prompts of new lengths each stalled
the engine for ~1-1.9 s of JIT).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.runtime import env
from kiln.runtime.kernels import _pdl, tuned_configs
from kiln.runtime.kernels._checks import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    check_tensor,
    next_pow2,
    scale_tensor,
)
from kiln.runtime.kernels._pdl import pdl_begin, prefetch_l2

LOG2E = 1.4426950408889634

# Which sequences a launch computes (the kernels' ``rows`` argument): every one; or, the two
# launches of a mixed step (prompt chunks beside decodes), the one-query sequences in decode
# tiles, one program per sequence, and the others in prompt tiles.
ROWS_ALL, ROWS_SINGLE, ROWS_MULTI = 0, 1, 2
ALL_ROWS = tl.constexpr(ROWS_ALL)
SINGLE_ROWS = tl.constexpr(ROWS_SINGLE)
MULTI_ROWS = tl.constexpr(ROWS_MULTI)


@triton.jit
def _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    # Program p belongs to the last sequence s with qsl[s] // BLOCK_Q + s <= p (each
    # sequence gets cdiv(query_len, BLOCK_Q) tiles, at most qsl-step // BLOCK_Q + 1).
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _seq_of_token(qsl_ptr, num_seqs, t):
    # the last sequence s with qsl[s] <= t: the one holding token t (empty ones start at
    # the same offset as the next sequence, so they are never the last)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefetch_kv(kc_ptr, vc_ptr, bt_row, lo, hi, live, stride_kb, stride_ks, stride_vb, stride_vs,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 LINE: tl.constexpr, D_LINES: tl.constexpr):
    """L2-prefetch the K and V rows of keys [lo, hi) (pointers at the kv head), one hint per
    LINE elements (a 128-byte line). Reads only the block table."""
    cols = tl.arange(0, D_LINES) * LINE
    c_ok = cols < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        ok = (kpos < hi) & live
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        off = kpos % BLOCK_SIZE
        m = ok[:, None] & c_ok[None, :]
        prefetch_l2(kc_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + cols[None, :],
                    m)
        prefetch_l2(vc_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + cols[None, :],
                    m)


@triton.jit
def _e4m3_to_f16(x):
    """e4m3 -> float16 (exact), four bytes a 32-bit register, two values an instruction, in
    inline PTX. (Triton 3.6 still reads V's dot operand from shared memory a byte at a time
    before it: the same 128 ``LDS.U8`` a thread per 128-key tile as ``.to``, plus the byte
    packing; the capped launches it serves were measured with it.)"""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
        "cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _e4m3_byte(w, i: tl.constexpr):
    """Byte ``i`` of each 32-bit word, as the e4m3 value it holds, in float16 (exact)."""
    return ((w >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _e4m3_words_to_f16(w, PTX: tl.constexpr):
    """Four e4m3 values a 32-bit word -> four float16 tensors (bytes 0..3): in inline PTX, two
    values an instruction (sm_90: 5 byte permutes a program, against 357 by shifts), or by shifts
    (the interpreter, which runs no PTX)."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 r0, r1; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 r0, lo; cvt.rn.f16x2.e4m3x2 r1, hi; "
            "mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    else:
        return _e4m3_byte(w, 0), _e4m3_byte(w, 1), _e4m3_byte(w, 2), _e4m3_byte(w, 3)


@triton.jit
def _attend(
    m_i, l_i, acc, q, lo, hi, kc_ptr, vc_ptr, bt_row, stride_kb, stride_ks, stride_vb,
    stride_vs, qk_scale, qi, row_ok, prefix, q_len, mask_ptr, m_off, d, d_ok,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr,
    HAS_MASK: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr, V_ASM: tl.constexpr,
    BT_AHEAD: tl.constexpr,
):
    """Online-softmax update over keys [lo, hi) of one sequence (pointers at its kv head).

    STEP=False: keys visible to every row (only bounds masking). STEP=True: in-step keys,
    causal or tree-masked. BT_AHEAD: each tile's block ids are loaded one iteration ahead, so
    the K/V addresses do not hang on a load of the same iteration, and Triton's pipeliner
    gives the K/V tiles num_stages - 1 shared-memory buffers instead of one (an FP8 decode
    tile is then double-buffered at num_stages 3).
    """
    if BT_AHEAD:
        kpos0 = lo + tl.arange(0, BLOCK_N)
        blk_next = tl.load(bt_row + kpos0 // BLOCK_SIZE, mask=kpos0 < hi, other=0)
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        if BT_AHEAD:
            blk = blk_next.to(tl.int64)
            kpos_next = kpos + BLOCK_N
            blk_next = tl.load(bt_row + kpos_next // BLOCK_SIZE, mask=kpos_next < hi, other=0)
        else:
            blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        off = kpos % BLOCK_SIZE
        k = tl.load(kc_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ks + d[:, None],
                    mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [D_PAD, BLOCK_N]
        if V_ASM >= 2:  # FP8 V read as 32-bit words, converted before the dot's layout (3:
            # without PTX); head_dim is D_PAD and the rows 4-byte aligned (``_v_form``)
            d4 = tl.arange(0, d.shape[0] // 4)
            w = tl.load(vc_ptr.to(tl.pointer_type(tl.int32)) + blk[:, None] * (stride_vb // 4)
                        + off[:, None] * (stride_vs // 4) + d4[None, :],
                        mask=k_ok[:, None], other=0)
            a0, a1, a2, a3 = _e4m3_words_to_f16(w, V_ASM == 2)
            v = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [BLOCK_N, d.shape[0]])
        else:
            v = tl.load(vc_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs
                        + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if KV_FP8:  # e4m3 -> float16 is one conversion per two values (the scales are
            # folded into q and the output); V through inline PTX in capped launches (V_ASM)
            k = k.to(q.dtype)
            if V_ASM == 1:
                v = _e4m3_to_f16(v)
            elif V_ASM == 0:
                v = v.to(q.dtype)
        if IEEE:  # float32 inputs, or bf16 under the interpreter (see _dot_in_fp32)
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if STEP:
            j = kpos[None, :] - prefix  # in-step key index
            see = j <= qi[:, None]
            if HAS_MASK:
                tree = tl.where(m_off >= 0, j >= 0, False)  # [1, BLOCK_N]
                mval = tl.load(mask_ptr + m_off + qi[:, None] * q_len + j,
                               mask=tree & row_ok[:, None] & k_ok[None, :], other=0)
                see = tl.where(tree, mval != 0, see)
            see = see & row_ok[:, None] & k_ok[None, :]
        else:
            see = k_ok[None, :]
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "min_chunk", "rows"])
def _paged_attn_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr,
    q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, ctx_ptr, mask_ptr, mask_off_ptr,
    qk_scale, k_scale_ptr, v_scale_ptr, num_seqs, num_heads, num_splits, min_chunk, rows,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    QPK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MULTI: tl.constexpr, HAS_MASK: tl.constexpr,
    KV_FP8: tl.constexpr, Q_F32: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    STAGED_EARLY: tl.constexpr, KV_PREFETCH: tl.constexpr,
    LINE: tl.constexpr, D_LINES: tl.constexpr, V_ASM: tl.constexpr, BT_AHEAD: tl.constexpr,
):
    if not STAGED_EARLY:
        pdl_begin(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # The step's metadata (query_start_loc, context_lens, mask offsets) is uploaded before the
    # step's kernels run and no kernel writes it: with STAGED_EARLY it is read before the PDL
    # wait, while the kernel before this one (rotary + KV write) still runs.
    # ``rows`` (a runtime value: no new variant per mode): ALL_ROWS, or one of a mixed
    # step's two launches, SINGLE_ROWS (program = sequence, only one-query sequences) or
    # MULTI_ROWS (only sequences of several queries): see ``paged_attention``
    if rows == SINGLE_ROWS:
        seq = pid
    else:
        seq = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if rows == SINGLE_ROWS:
        q_tile = 0
    else:
        q_tile = pid - (q_start // BLOCK_Q + seq)
    mine = q_tile * BLOCK_Q < q_len
    if rows == SINGLE_ROWS:
        mine = q_len == 1
    elif rows == MULTI_ROWS:
        mine = mine & (q_len > 1)
    ctx = tl.load(ctx_ptr + seq)
    prefix = ctx - q_len
    if HAS_MASK:
        m_off = tl.load(mask_off_ptr + seq)
    # Keys this tile can see: causal stops at its last query; a tree mask may look anywhere
    # in the step.
    last_q = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    kv_end = prefix + last_q
    if HAS_MASK:
        kv_end = tl.where(m_off >= 0, ctx, kv_end)
    # keys per split: an even share of this tile's keys, at least ``min_chunk`` (a graph's
    # split count is fixed for its longest context; short ones then leave splits empty)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N, min_chunk)
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_end, kv_lo + chunk)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_base = kvh * stride_kh
    vv_base = kvh * stride_vh
    if KV_PREFETCH:  # the split's first key tiles into L2 (the block table is staged)
        _prefetch_kv(kc_ptr + kv_base, vc_ptr + vv_base, bt_row, kv_lo,
                     tl.minimum(kv_hi, kv_lo + KV_PREFETCH * BLOCK_N),
                     mine, stride_kb, stride_ks, stride_vb, stride_vs,
                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, LINE, D_LINES)
    if STAGED_EARLY:  # every program waits, also those that return at once: the kernel
        # completes only after the one before it (the PDL chain stays transitive)
        pdl_begin(PDL)
    if not mine:  # (the other launch of a mixed step computes this sequence)
        return

    r = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + r // QPK  # query index within the sequence, [BLOCK_M]
    head = kvh * QPK + r % QPK
    row_ok = (r < BLOCK_Q * QPK) & (qi < q_len)
    tok = (q_start + qi).to(tl.int64)
    # partials' row: the token; SINGLE_ROWS partials are per sequence (one query each)
    prow = tok
    if rows == SINGLE_ROWS:
        prow = tok * 0 + seq

    if MULTI:
        if kv_lo >= kv_end:  # no key in this split (a context shorter than the graph's
            # split count allows): mark the partial empty for the reduce and stop
            ph = (prow * num_heads + head) * num_splits + split
            tl.store(part_ml_ptr + ph * 2, tl.full([BLOCK_M], float("-inf"), tl.float32),
                     mask=row_ok)
            tl.store(part_ml_ptr + ph * 2 + 1, tl.zeros([BLOCK_M], tl.float32), mask=row_ok)
            return
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, D_PAD]

    # FP8 K/V: the dots run in float16 (e4m3 converts to it in one instruction per two
    # values; to bfloat16 it goes through float32), with k_scale folded into q and v_scale
    # applied to the output. float32 q (the interpreter's oracle runs) stays float32.
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        q = q.to(tl.float32) * k_scale
        if not Q_F32:
            q = q.to(tl.float16)
    else:
        k_scale = 1.0
        v_scale = 1.0
    if not HAS_MASK:
        m_off = -1
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Two passes: keys every row of the tile may see (the cached prefix, and under a causal
    # mask also the step keys up to the tile's first query: all of a decode), with no masking
    # work; then the rest of the step's keys (causal or tree mask).
    open_end = prefix + q_tile * BLOCK_Q + 1
    if HAS_MASK:
        open_end = tl.where(m_off >= 0, prefix, open_end)
    mid = tl.maximum(kv_lo, tl.minimum(kv_hi, open_end))
    m_i, l_i, acc = _attend(
        m_i, l_i, acc, q, kv_lo, mid, kc_ptr + kv_base, vc_ptr + vv_base,
        bt_row, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
        qi, row_ok, prefix, q_len, mask_ptr, m_off, d, d_ok,
        BLOCK_SIZE, BLOCK_N, False, HAS_MASK, KV_FP8, IEEE, V_ASM, BT_AHEAD)
    m_i, l_i, acc = _attend(
        m_i, l_i, acc, q, mid, kv_hi, kc_ptr + kv_base, vc_ptr + vv_base,
        bt_row, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
        qi, row_ok, prefix, q_len, mask_ptr, m_off, d, d_ok,
        BLOCK_SIZE, BLOCK_N, True, HAS_MASK, KV_FP8, IEEE, V_ASM, BT_AHEAD)

    if KV_FP8:
        acc = acc * v_scale
    o_mask = row_ok[:, None] & d_ok[None, :]
    if not MULTI:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # partials: acc [T, H, S, D_PAD], (m, l) [T, H, S, 2], all float32 (T: the
        # sequences for SINGLE_ROWS)
        ph = (prow * num_heads + head) * num_splits + split
        tl.store(part_acc_ptr + ph[:, None] * D_PAD + d[None, :], acc, mask=o_mask)
        tl.store(part_ml_ptr + ph * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + ph * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "num_seqs", "rows"])
def _reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr, num_seqs, rows, num_heads, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    # program 0: a token (ALL_ROWS, MULTI_ROWS) or a sequence (SINGLE_ROWS), its partials' row
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    tok = t
    if rows == SINGLE_ROWS:
        q0 = tl.load(qsl_ptr + t)
        if tl.load(qsl_ptr + t + 1) - q0 != 1:
            return
        tok = q0.to(tl.int64)
    elif rows == MULTI_ROWS:
        seq = _seq_of_token(qsl_ptr, num_seqs, t.to(tl.int32))
        if tl.load(qsl_ptr + seq + 1) - tl.load(qsl_ptr + seq) == 1:
            return
    sp = tl.arange(0, S_PAD)
    s_ok = sp < num_splits
    base = (t * num_heads + h) * num_splits
    m = tl.load(part_ml_ptr + (base + sp) * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits: m = -inf → 0
    total = tl.sum(l * w, 0)
    d = tl.arange(0, D_PAD)
    # empty splits (m = -inf) wrote no accumulator: not read (masked lanes touch no memory).
    # Masking on m (rather than loading every accumulator and zeroing the empty splits'
    # afterwards) skips the empty splits' reads: 8B FP8 engine step 2.646 vs 2.675 ms.
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * D_PAD + d[None, :],
                  mask=(s_ok & (m > float("-inf")))[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@functools.cache
def _num_sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """float32 dots in IEEE precision (not tf32). Triton's CPU interpreter (3.9) returns
    garbage for bf16 tl.dot, so there bf16 operands are widened first: the same numbers, as
    bf16 products are exact in float32 and the accumulation is float32 either way."""
    return dtype == torch.float32 or (env.triton_interpret() and dtype == torch.bfloat16)


# Before its PDL wait each program L2-prefetches the K/V rows of this many key tiles at the
# start of its split (0: off). 8B FP8 batch-1 engine step: 2.641 -> 2.626 ms at contexts
# 129-256, 2.752 -> 2.733 at 1793-1920; the whole split instead of 2 tiles: the same.
KV_PREFETCH_TILES = 2


MAX_SPLITS = 64  # the most key-splits choose_num_splits picks


def reduce_width(num_splits: int) -> int:
    """The split reduce's padded width (a compile-time constant): 16, 32 or 64 for up to
    MAX_SPLITS splits, so the split counts of eager steps (which follow their lengths) share
    three reduce variants; CUDA graphs' usual 16 splits keep their tight width."""
    return max(16, next_pow2(num_splits))


def choose_num_splits(
    num_programs: int, max_context_len: int, num_sms: int = 132, block_n: int = 64,
    tiles_per_split: int = 2,
) -> int:
    """Key-splits so that about 4 programs per SM run (decode at small batch needs them);
    each split keeps at least ``tiles_per_split`` key tiles (default 2: a program's time is
    mostly its tile count times the load latency at batch 1: 2 tiles per split measured
    9.6 us, 5 tiles 15.8 us; a tuned config may choose another)."""
    if num_programs >= 2 * num_sms:
        return 1
    want = triton.cdiv(4 * num_sms, num_programs)
    return max(1, min(want, triton.cdiv(max_context_len, tiles_per_split * block_n),
                      MAX_SPLITS))


def _v_form(asked, kv_fp8: bool, on_gpu: bool, f16_q: bool, capped: bool,
            words_ok: bool) -> int:
    """The kernel's V_ASM: 0 (``.to``), 1 (inline PTX on V's dot operand, in capped launches
    with a float16 query), 2 (V read as 32-bit words and converted before the dot's layout: a
    config's ``"v_asm": 2``, where the head is not padded, V's rows are 4-byte aligned and the
    query is not float32) or 3 (the same under the interpreter, converted without PTX)."""
    if not kv_fp8:
        return 0
    if asked == 2 and words_ok and f16_q:
        return 2 if on_gpu else 3
    return int(on_gpu and f16_q and capped and bool(asked))


def default_config(head_dim: int, qclass: str = "decode", kv_fp8: bool = False) -> dict:
    """The launch config used when nothing is tuned for a shape (engine.json has none).

    Decodes over an FP8 cache of heads up to 128 wide take 128-key tiles: llama-3-8b shape,
    H100, batch 256 at ~1000 tokens of context 234 us against 288 us for 64-key tiles; batch
    64 at ~4000 tokens 220 vs 343 us; batch 16 at ~8000 118 vs 186 us; and a 128-register cap
    where a launch has one split a program (``_launch``): 4 programs an SM instead of 3, batch
    64 at ~4000 251 -> 195 us, 256 at ~1000 231 -> 216 us
    (benchmarks/attention_mixed.py; docs/decisions.md, "FP8 KV attention").

    Tree-masked steps (``qclass`` "tree") of 128-wide heads take 32-key tiles: at the
    Qwen2.5-1.5B / 7B shapes, 24 and 84 queries per sequence, batch 1, contexts 256-3072,
    0.69-0.94x the time of 64-key tiles (docs/decisions.md, "Attention of speculative
    steps")."""
    d_pad = next_pow2(max(head_dim, 16))
    block_n = 32 if d_pad > 128 or (qclass == "tree" and d_pad == 128) else 64
    if qclass == "prefill" and d_pad <= 128:
        # 128-row tiles, three stages: four 1000-token prompts at the llama-3-8b shape, H100,
        # 216 us (bf16 KV) / 211 us (FP8 KV) against 322 / 263 us for 64-row tiles and two
        # stages (benchmarks/attention_mixed.py; docs/decisions.md)
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                "tiles_per_split": 2}
    if qclass == "decode" and kv_fp8 and d_pad <= 128:
        return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "tiles_per_split": 2,
                "maxnreg": 128}
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2, "tiles_per_split": 2}


def query_class(max_query_len: int, qpk: int, masked: bool = False) -> str:
    """decode (one query per sequence), tree (speculative steps: a few dozen queries under
    tree masks, 16-row tiles by default), multi (few causal queries: short chunks; BLOCK_M
    16) or prefill (BLOCK_M 64). Configs are tuned per class: one class shares its default
    BLOCK_M, so a config that compiled for one of its shapes compiles for all of them."""
    if max_query_len <= 1:
        return "decode"
    if masked:
        return "tree"
    return "prefill" if max_query_len * qpk >= 64 else "multi"


@functools.lru_cache(maxsize=256)
def tuning_key(kv_heads: int, qpk: int, head_dim: int, dtype: torch.dtype | str,
               kv_dtype: torch.dtype | str, max_query_len: int, masked: bool = False) -> str:
    """The key of ``tuned_configs.lookup("paged_attention", key)``, e.g.
    ``kvh8-qpk4-d128-bfloat16-kvbfloat16-decode``."""
    def name(dt: torch.dtype | str) -> str:
        return str(dt).removeprefix("torch.")

    return (f"kvh{kv_heads}-qpk{qpk}-d{head_dim}-{name(dtype)}-kv{name(kv_dtype)}-"
            f"{query_class(max_query_len, qpk, masked)}")


_warned_fallback: set[str] = set()


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
    scale: float, *, max_query_len: int, max_context_len: int,
    mask: torch.Tensor | None = None, mask_offsets: torch.Tensor | None = None,
    k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
    num_splits: int | None = None, out: torch.Tensor | None = None,
    config: dict | None = None, single_rows: int | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D] over one layer's paged cache [num_blocks, block_size, KVH, D].

    block_tables [num_seqs, max_blocks] int32; query_start_loc [num_seqs + 1] int32
    (ascending, last = T); context_lens [num_seqs] int32 (cached prefix + query_len).
    max_context_len is a host-side upper bound (it sizes the split count; no host sync).
    max_query_len only picks the launch config and the split count: it is **not** a bound.
    CUDA graphs replay short prefills (a 40-token prompt in the 64-sequence, 64-token decode
    bucket, captured with max_query_len 1), so any sequence may have more queries and the
    kernel covers them all (the grid is sized from T). mask: packed uint8/bool tree masks,
    mask_offsets [num_seqs] int32 (-1 = causal). An FP8 cache is dequantised with k_scale /
    v_scale (floats or 1-element float32 device tensors, e.g.
    ``cache.k_scale[layer : layer + 1]``). num_splits fixes the key-split count (CUDA graphs
    want a static one). ``config`` forces a launch config (BLOCK_N, num_warps, num_stages,
    tiles_per_split; optionally BLOCK_M, the tile rows, min_split_tiles, the least key
    tiles per split of a context, maxnreg, a register cap for launches of one split, v_asm
    (False: an FP8 capped launch converts V with ``.to``), and bt_ahead, block ids loaded a
    tile ahead); by default the one tuned for this shape
    (``tuned_configs.lookup``, see ``tuning_key``) or ``default_config``; it applies to the
    prompt launch of a mixed step. ``single_rows``: how many sequences have exactly one
    query, when the host knows (None: unknown, e.g. a CUDA graph's bucket). An unmasked step
    with several queries somewhere and more than one sequence runs two launches (decodes in
    decode tiles, the rest in prompt tiles) unless ``single_rows`` says every sequence is of
    one kind. Returns [T, H, D] in q's dtype.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    dev = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,) + FP8_DTYPES, device=dev)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=dev)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=dev)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=dev)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,), device=dev)
    t, heads, dim = q.shape
    _, block_size, kv_heads, kdim = k_cache.shape
    if kdim != dim or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must both be "
            f"[num_blocks, block_size, kv_heads, {dim}] to match q {tuple(q.shape)}"
        )
    if heads % kv_heads:
        raise ValueError(f"num_heads {heads} must be a multiple of kv_heads {kv_heads} (GQA)")
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries and block_tables "
            f"{block_tables.shape[0]} rows; with {num_seqs} context_lens they need "
            f"{num_seqs + 1} and {num_seqs}"
        )
    if max_context_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_context_len {max_context_len} exceeds the block table's capacity "
            f"{block_tables.shape[1]} blocks x {block_size}"
        )
    if (mask is None) != (mask_offsets is None):
        raise ValueError("mask and mask_offsets go together: pass both or neither")
    if mask is not None:
        check_tensor("mask", mask, ndim=1, dtypes=(torch.bool, torch.uint8), device=dev)
        check_tensor("mask_offsets", mask_offsets, ndim=1, dtypes=(torch.int32,), device=dev)
        if mask_offsets.shape[0] != num_seqs:
            raise ValueError(f"mask_offsets has {mask_offsets.shape[0]} entries, need {num_seqs}")
        mask = mask.view(torch.uint8)
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    ks = scale_tensor("k_scale", k_scale, dev) if kv_fp8 else context_lens
    vs = scale_tensor("v_scale", v_scale, dev) if kv_fp8 else context_lens
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=dev)
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    if t == 0 or num_seqs == 0:
        return out

    # A mixed step (prompt chunks beside decodes) runs two launches, each at its own tile
    # shape: the one-query sequences in decode tiles, one program per sequence, and the
    # others in prompt tiles. One launch runs every decode in the prompt class's tiles
    # (llama-3-8b shape, FP8 KV, 256 decodes beside four 1000-token prompts: 545 us one
    # launch, 498 us two; docs/decisions.md, "Mixed steps").
    mixed = (mask is None and max_query_len > 1 and num_seqs > 1
             and (single_rows is None or 0 < single_rows < num_seqs))
    common = (out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, mask,
              mask_offsets, scale * LOG2E, ks, vs)
    if mixed:
        _run(common, 1, max_context_len, num_splits, None, ROWS_SINGLE)
        _run(common, max_query_len, max_context_len, num_splits, config, ROWS_MULTI)
    else:
        _run(common, max_query_len, max_context_len, num_splits, config, ROWS_ALL)
    return out


def _run(common: tuple, max_query_len: int, max_context_len: int, num_splits: int | None,
         config: dict | None, rows: int) -> None:
    """One launch (and its split reduction) for the sequences ``rows`` selects, with
    ``config`` or the one tuned for the class of ``max_query_len`` queries (the default
    config when a tuned one does not fit, said once)."""
    q, k_cache, mask = common[1], common[2], common[7]
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    qpk = heads // kv_heads
    default = default_config(dim, query_class(max_query_len, qpk, mask is not None),
                             k_cache.dtype in FP8_DTYPES)
    key = None
    if config is None:
        key = tuning_key(kv_heads, qpk, dim, q.dtype, k_cache.dtype, max_query_len,
                         mask is not None)
        config = tuned_configs.lookup("paged_attention", key) or default
    args = (*common, max_query_len, max_context_len, num_splits)
    try:
        _launch(*args, config, rows)
    except triton.runtime.errors.OutOfResources as e:
        if key is None or config is default:
            raise
        # A tuned config that ran on the tuned shapes but does not fit this one (the key's
        # shapes share BLOCK_M, so this should not happen): defaults, said once.
        if key not in _warned_fallback:
            _warned_fallback.add(key)
            print(f"warning: tuned paged_attention config {config} for {key} does not fit "
                  f"({e}); using the default config", file=sys.stderr)
        _launch(*args, default, rows)


def _launch(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
    mask: torch.Tensor | None, mask_offsets: torch.Tensor | None, qk_scale: float,
    ks: torch.Tensor, vs: torch.Tensor, max_query_len: int, max_context_len: int,
    num_splits: int | None, config: dict, rows: int = ROWS_ALL,
) -> None:
    """Launch the attention kernel (and the split reduction) with one launch config, for
    the sequences ``rows`` selects (ALL_ROWS, SINGLE_ROWS or MULTI_ROWS)."""
    t, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    dev = q.device
    qpk = heads // kv_heads
    block_m = int(config.get("BLOCK_M", 64 if max_query_len * qpk >= 64 else 16))
    block_m = max(block_m, next_pow2(qpk))
    block_q = block_m // qpk
    d_pad = next_pow2(max(dim, 16))
    block_n = int(config["BLOCK_N"])
    single = rows == ROWS_SINGLE
    # SINGLE_ROWS: one program per sequence; partials (and the reduce) per sequence
    num_q_programs = num_seqs if single else t // block_q + num_seqs
    num_rows = num_seqs if single else t
    if num_splits is None:
        sms = _num_sms(dev)
        live = min(num_q_programs, num_seqs * triton.cdiv(max_query_len, block_q))
        num_splits = choose_num_splits(live * kv_heads, max_context_len, sms, block_n,
                                       int(config.get("tiles_per_split", 2)))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    min_chunk = int(config.get("min_split_tiles", 0)) * block_n
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    if num_splits > 1:
        part_acc = torch.empty(num_rows, heads, num_splits, d_pad, dtype=torch.float32,
                               device=dev)
        part_ml = torch.empty(num_rows, heads, num_splits, 2, dtype=torch.float32, device=dev)
    else:
        part_acc = part_ml = out  # unused
    early, esize = _pdl.staged_early(), k_cache.element_size()
    on_gpu = dev.type == "cuda" and not env.triton_interpret()
    # A register cap (a tuned or default config's ``maxnreg``) for launches of one split a
    # program: they have programs enough to fill the SMs, and more of them resident hide the
    # loads. Split launches have few programs, where the cap's spills cost more than it gives.
    # Capped FP8 launches convert V through inline PTX (V_ASM; a config's ``"v_asm": False``
    # turns it off), the form the cap was measured with; uncapped it is slower
    # (docs/decisions.md, "FP8 KV attention").
    regs = ({"maxnreg": int(config["maxnreg"])}
            if on_gpu and num_splits == 1 and config.get("maxnreg") else {})
    v_asm = config.get("v_asm", True)
    words_ok = v_asm == 2 and dim == d_pad and v_cache.data_ptr() % 4 == 0 and all(
        st % 4 == 0 for st in v_cache.stride()[:3])  # (checked only where a config asks)
    _paged_attn_kernel[(num_q_programs, kv_heads, num_splits)](
        out, part_acc, part_ml, q, k_cache, v_cache, block_tables, query_start_loc,
        context_lens, mask if mask is not None else context_lens,
        mask_offsets if mask_offsets is not None else context_lens,
        qk_scale, ks, vs, num_seqs, heads, num_splits, min_chunk, rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        QPK=qpk, HEAD_DIM=dim, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_N=block_n, MULTI=num_splits > 1,
        HAS_MASK=mask is not None, KV_FP8=kv_fp8, Q_F32=q.dtype == torch.float32,
        IEEE=_dot_in_fp32(q.dtype),
        STAGED_EARLY=early,
        KV_PREFETCH=KV_PREFETCH_TILES if early else 0, LINE=128 // esize,
        D_LINES=next_pow2(triton.cdiv(dim * esize, 128)),
        V_ASM=_v_form(v_asm, kv_fp8, on_gpu, q.dtype != torch.float32, bool(regs), words_ok),
        BT_AHEAD=bool(config.get("bt_ahead", False)), num_warps=int(config["num_warps"]),
        num_stages=int(config["num_stages"]), **regs, **_pdl.launch_kwargs(),
    )
    if num_splits > 1:
        _reduce_kernel[(num_rows, heads)](
            out, part_acc, part_ml, query_start_loc, num_seqs, rows, heads, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=dim, D_PAD=d_pad, S_PAD=reduce_width(num_splits), num_warps=4,
            **_pdl.launch_kwargs(),
        )


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
    scale: float, *, mask: torch.Tensor | None = None, mask_offsets: torch.Tensor | None = None,
    k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """TorchAttention's semantics on the kernel's inputs, one sequence at a time, in float32."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    qsl, ctxs = query_start_loc.tolist(), context_lens.tolist()
    offs = mask_offsets.tolist() if mask_offsets is not None else [-1] * len(ctxs)
    for s, ctx in enumerate(ctxs):
        q0, q1 = qsl[s], qsl[s + 1]
        n = q1 - q0
        idx = torch.arange(ctx, device=q.device)
        blocks = block_tables[s].long()[idx // block_size]
        ks = k_cache[blocks, idx % block_size].float()  # [ctx, KVH, D]
        vs = v_cache[blocks, idx % block_size].float()
        if k_cache.dtype in FP8_DTYPES:
            ks, vs = ks * k_scale, vs * v_scale
        see = torch.ones(n, ctx, dtype=torch.bool, device=q.device)
        if offs[s] >= 0:
            see[:, ctx - n:] = mask[offs[s] : offs[s] + n * n].view(n, n).bool()
        else:
            see[:, ctx - n:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        o = F.scaled_dot_product_attention(
            q[q0:q1].float().transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
            attn_mask=see, scale=scale, enable_gqa=q.shape[1] != ks.shape[1],
        )
        out[q0:q1] = o.transpose(0, 1).to(q.dtype)
    return out


def flops_and_bytes(context_lens: list[int], query_lens: list[int], heads: int, kv_heads: int,
                    dim: int, elem: int) -> tuple[float, float]:
    """Matmul FLOPs and the fewest bytes (K/V read once, q read, out written) of one call."""
    keys = sum(context_lens)
    qs = sum(query_lens)
    flops = 4.0 * heads * dim * sum(c * n for c, n in zip(context_lens, query_lens))
    return flops, float(elem * (2 * keys * kv_heads * dim + 2 * qs * heads * dim))
