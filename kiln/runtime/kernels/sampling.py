"""Greedy and temperature sampling over the vocabulary in two small kernels.

``sample_tokens(logits [R, V] float32, inv_temp, seed)`` -> token ids [R] (int64). Row r's
token is ``argmax_v logits[r, v]`` where ``inv_temp[r] == 0`` (greedy: the first maximum, as
``torch.argmax``), else ``argmax_v logits[r, v] * inv_temp[r] + G_rv`` with ``G_rv`` i.i.d.
Gumbel(0, 1) from Philox(seed): the Gumbel-max form of ``Sampler``'s exponential race, so
token v wins with probability ``softmax(logits[r] * inv_temp[r])_v`` and no softmax is
computed. ``-inf`` logits (masked tokens) never win a sampled row. A row that holds NaN or
+inf, or only -inf, yields -1 (the sampler's ``INVALID_TOKEN``: the engine fails that request;
the next step's input copy clamps it to a valid id): the check is one comparison in the final
kernel, free beside its loads.

Why: torch's argmax over one row of 128256 logits runs as one block (27 us) and its
softmax as another (34 us); a batch-1 decode step of llama-3-8b is 2.8 ms. Here the vocabulary is
split over ``cdiv(V, BLOCK)`` programs
per row, each writing its best (value, index), and a second kernel picks each row's best.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import check_tensor
from kiln.runtime.kernels._pdl import pdl_begin

BLOCK = 2048  # vocabulary entries per program: 63 programs per row for a 128256 vocabulary
MAX_PARTS = 1024  # BLOCK x MAX_PARTS = the largest vocabulary (2 M)
# warped plan rows' thresholds: each part's WARP_CANDIDATES largest scaled logits, merged per
# row, settle top-k (k < WARP_CANDIDATES) and top-p (a nucleus among them); other rows search
# the whole row, one program each: a 16-way search over the float keys (8 passes over the
# row per search, [WAYS, BLOCK] comparisons per chunk)
WARP_CANDIDATES = 64
THRESHOLD_BLOCK, THRESHOLD_WAYS = 256, 16


# The seed changes every step: never a specialisation (a seed divisible by 16, as greedy's 0,
# compiled another variant, a ~0.5 s stall at the first sampled request).
@triton.jit(do_not_specialize=["seed", "num_plans"])
def _sample_partial_kernel(
    logits_ptr, inv_temp_ptr, key_ptr, val_ptr, idx_ptr, V, parts, stride_r, inv_temp, seed,
    plan_slot_ptr, plan_r0_ptr, depth_ptr, num_plans, T, thr_ptr,
    PER_ROW: tl.constexpr, ROW_KEYS: tl.constexpr, PLANS: tl.constexpr, WARP: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)  # rows x V may pass 2**31
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(logits_ptr + row * stride_r + offs, mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    # NaN is the largest value, as in torch.argmax (the first NaN wins a greedy row): without
    # this a NaN row's comparisons all fail and the winner may be a masked lane, a token id
    # past the vocabulary that the next step's embedding lookup turns into a device assert
    x = tl.where(x == x, x, float("inf"))
    if PER_ROW:
        inv_temp = tl.load(inv_temp_ptr + row)
    if PLANS:
        # speculative plans (sample_plan_rows): the plan that holds this row, if any, gives
        # its inverse temperature and key where the row verifies (depth >= 0)
        key = seed.to(tl.int64) * 0
        for e in range(num_plans):
            j = row - tl.load(plan_r0_ptr + e)
            inside = (tl.load(plan_slot_ptr + e) >= 0) & (j >= 0) & (j < T)
            d = tl.load(depth_ptr + tl.where(inside, j, 0))
            take = inside & (d >= 0)
            inv_temp = tl.where(take, tl.load(inv_temp_ptr + e), inv_temp)
            key = tl.where(take, tl.load(key_ptr + e) + (d.to(tl.int64) << 32), key)
    if inv_temp > 0:
        # [0, 1), one Philox stream per row: its own key, or (seed, row); u == 0 gives
        # G = -inf: never wins
        if PLANS:
            pass
        elif ROW_KEYS:
            key = tl.load(key_ptr + row)
        else:
            key = seed + (row << 32)
        u = tl.rand(key, offs)
        scaled = x * inv_temp
        x = scaled - tl.log(-tl.log(u))
        if WARP:
            # top-k / top-p / min-p of the row's plan: only tokens at or above the row's
            # threshold (_warp_threshold_kernel; -inf where the plan does not warp) compete
            x = tl.where(scaled >= tl.load(thr_ptr + row), x, float("-inf"))
    # one reduction for both (tl.argmax is this call, keeping only the index)
    best, arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * parts + part, best)
    tl.store(idx_ptr + row * parts + part, part * BLOCK + arg)


@triton.jit
def _ordered(s):
    """float32 -> int32 keys in the floats' order (-inf lowest, +inf highest; no NaN)."""
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _unordered(k):
    """``_ordered``'s inverse (int64 keys in int32 range -> float32)."""
    k = k.to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _row_pass(base, V, inv, floor, m, t, MASS: tl.constexpr, BLOCK: tl.constexpr,
              WAYS: tl.constexpr):
    """For each threshold t [WAYS] (float32): the count (MASS False) or the mass
    sum exp(s - m) (MASS True) of the row's scaled logits s with s >= t and s >= floor."""
    acc = tl.zeros([WAYS], dtype=tl.float32)
    offs0 = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        offs = start + offs0
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        s = tl.where(x == x, x, float("inf")) * inv
        if MASS:
            w = tl.where(s >= floor, tl.exp(s - m), 0.0)
        else:
            w = tl.where((s >= floor) & (offs < V), 1.0, 0.0)
        acc += tl.sum(tl.where(s[None, :] >= t[:, None], w[None, :], 0.0), axis=1)
    return acc


@triton.jit
def _row_search(base, V, inv, floor, m, lo, hi, target, MASS: tl.constexpr,
                BLOCK: tl.constexpr, WAYS: tl.constexpr):
    """The largest float t (as an ``_ordered`` key in [lo, hi)) whose ``_row_pass`` value
    reaches ``target``, given that lo's does and hi's does not: a WAYS-ary search over the
    keys, one pass over the row per round (32 bits: 8 rounds at 16 ways)."""
    i = tl.arange(0, WAYS).to(tl.int64)
    for _ in range(10):
        step = (hi - lo + WAYS - 1) // WAYS
        cand = lo + step * i
        valid = (cand < hi) & (i > 0)
        cand = tl.where(valid, cand, lo)
        got = _row_pass(base, V, inv, floor, m, _unordered(cand), MASS, BLOCK, WAYS)
        ok = got >= target
        new_lo = tl.max(tl.where(valid & ok, cand, lo), axis=0)
        hi = tl.min(tl.where(valid & (ok == 0), cand, hi), axis=0)
        lo = new_lo
    return _unordered(lo)


@triton.jit
def _plan_warp(row, inv_temp_ptr, warp_ptr, plan_slot_ptr, plan_r0_ptr, depth_ptr, num_plans,
               T):
    """The verifying plan row ``row`` belongs to: (inv_temp, top_k, top_p, min_p); 0, 0,
    1, 0 for rows of no plan and rows that do not verify."""
    inv = 0.0
    top_k = 0.0
    top_p = 1.0
    min_p = 0.0
    for e in range(num_plans):
        j = row - tl.load(plan_r0_ptr + e)
        inside = (tl.load(plan_slot_ptr + e) >= 0) & (j >= 0) & (j < T)
        d = tl.load(depth_ptr + tl.where(inside, j, 0))
        take = inside & (d >= 0)
        inv = tl.where(take, tl.load(inv_temp_ptr + e), inv)
        top_k = tl.where(take, tl.load(warp_ptr + 3 * e), top_k)
        top_p = tl.where(take, tl.load(warp_ptr + 3 * e + 1), top_p)
        min_p = tl.where(take, tl.load(warp_ptr + 3 * e + 2), min_p)
    return inv, top_k, top_p, min_p


@triton.jit(do_not_specialize=["num_plans"])
def _warp_parts_kernel(logits_ptr, stats_ptr, cand_ptr, V, parts, stride_r, inv_temp_ptr,
                       warp_ptr, plan_slot_ptr, plan_r0_ptr, depth_ptr, num_plans, T,
                       BLOCK: tl.constexpr, M: tl.constexpr, PDL: tl.constexpr):
    """Per (row, part of the vocabulary) of a warped plan row: the part's largest scaled
    logit s and sum of exp(s - that max) (``stats``), and its M largest s in order
    (``cand``). Other rows return at once."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    inv, top_k, top_p, min_p = _plan_warp(row, inv_temp_ptr, warp_ptr, plan_slot_ptr,
                                          plan_r0_ptr, depth_ptr, num_plans, T)
    if (inv > 0) & (((top_k > 0) & (top_k < V)) | (top_p < 1.0) | (min_p > 0.0)):
        ar = tl.arange(0, BLOCK)
        offs = part * BLOCK + ar
        x = tl.load(logits_ptr + row * stride_r + offs, mask=offs < V,
                    other=float("-inf")).to(tl.float32)
        s = tl.where(x == x, x, float("inf")) * inv
        mp = tl.max(s, axis=0)
        zp = tl.sum(tl.where(s > float("-inf"), tl.exp(s - mp), 0.0), axis=0)
        sbase = stats_ptr + (row * parts + part) * 2
        tl.store(sbase, mp)
        tl.store(sbase + 1, zp)
        cbase = cand_ptr + (row * parts + part) * M
        for i in range(M):
            v, a = tl.max(s, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(cbase + i, v)
            s = tl.where(ar == a, float("-inf"), s)


@triton.jit
def _full_threshold(base, V, inv, m, use_k, top_k, top_p, BLOCK: tl.constexpr,
                    WAYS: tl.constexpr):
    """The top-k / top-p threshold by searching the whole row (``_row_search``): the rare
    rows whose kept tokens the M candidates do not settle."""
    thr = float("-inf")
    lo = _ordered(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
    hi = _ordered(m).to(tl.int64) + 1
    if use_k:
        thr = _row_search(base, V, inv, float("-inf"), m, lo, hi, top_k, False, BLOCK, WAYS)
    if top_p < 1.0:
        z = tl.max(_row_pass(base, V, inv, thr, m, tl.full([WAYS], float("-inf"), tl.float32),
                             True, BLOCK, WAYS), axis=0)
        thr = _row_search(base, V, inv, thr, m, _ordered(thr).to(tl.int64), hi, top_p * z,
                          True, BLOCK, WAYS)
    return thr


@triton.jit(do_not_specialize=["num_plans"])
def _warp_threshold_kernel(logits_ptr, thr_ptr, stats_ptr, cand_ptr, V, parts, stride_r,
                           inv_temp_ptr, warp_ptr, plan_slot_ptr, plan_r0_ptr, depth_ptr,
                           num_plans, T, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                           M: tl.constexpr, BLOCK: tl.constexpr, WAYS: tl.constexpr,
                           PDL: tl.constexpr):
    """Row r's threshold on its scaled logits s = logits * inv_temp where its plan samples
    with top-k, top-p or min-p (``warp`` [B, 3] float32: top_k (0: off), top_p, min_p):
    the largest t with {s >= t} = the tokens ``sampler.warp_batch`` keeps (top-k: the k-th
    largest s; then top-p over those: the value of the token whose cumulative mass, largest
    first, reaches top_p; min-p: max s + ln(min_p)). -inf elsewhere (every token competes).

    From ``_warp_parts_kernel``'s output: the row's max and mass, and its M largest s
    (merged from the parts' M largest), which settle top-k for k < M and top-p wherever
    the kept tokens are among them; otherwise (a flat row) the whole row is searched."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    inv, top_k, top_p, min_p = _plan_warp(row, inv_temp_ptr, warp_ptr, plan_slot_ptr,
                                          plan_r0_ptr, depth_ptr, num_plans, T)
    use_k = (top_k > 0) & (top_k < V)
    thr = float("-inf")
    if (inv > 0) & (use_k | (top_p < 1.0) | (min_p > 0.0)):
        po = tl.arange(0, BLOCK_P)
        sb = stats_ptr + (row * parts + po) * 2
        mps = tl.load(sb, mask=po < parts, other=float("-inf"))
        zps = tl.load(sb + 1, mask=po < parts, other=0.0)
        m = tl.max(mps, axis=0)
        z = tl.sum(tl.where(mps > float("-inf"), zps * tl.exp(mps - m), 0.0), axis=0)
        co = tl.arange(0, BLOCK_C)
        c = tl.load(cand_ptr + row * parts * M + co, mask=co < parts * M,
                    other=float("-inf"))
        mo = tl.arange(0, M)
        vals = tl.full([M], float("-inf"), tl.float32)
        for i in range(M):  # the row's M largest, in order
            v, a = tl.max(c, axis=0, return_indices=True, return_indices_tie_break_left=True)
            vals = tl.where(mo == i, v, vals)
            c = tl.where(co == a, float("-inf"), c)
        w = tl.where(vals > float("-inf"), tl.exp(vals - m), 0.0)
        ki = top_k.to(tl.int32)
        kth = tl.max(tl.where(mo == ki - 1, vals, float("-inf")), axis=0)
        # settled when the k-th is among them and no token outside may tie with it
        k_ok = (ki < M) & (tl.min(vals, axis=0) < kth)
        thr_k = tl.where(use_k, kth, float("-inf"))
        zk = tl.where(use_k, tl.sum(tl.where(vals >= kth, w, 0.0), axis=0), z)
        cum = tl.cumsum(tl.where(vals >= thr_k, w, 0.0), axis=0)
        hit = (cum >= top_p * zk) & (vals >= thr_k)
        first = tl.min(tl.where(hit, mo, M), axis=0)
        t_p = tl.max(tl.where(mo == first, vals, float("-inf")), axis=0)
        thr = tl.where(top_p < 1.0, tl.maximum(thr_k, t_p), thr_k)
        if (use_k & (k_ok == 0)) | ((top_p < 1.0) & (first >= M)):
            thr = _full_threshold(logits_ptr + row * stride_r, V, inv, m, use_k, top_k, top_p,
                                  BLOCK, WAYS)
        if min_p > 0.0:
            thr = tl.maximum(thr, m + tl.log(min_p))
    tl.store(thr_ptr + row, thr)


@triton.jit
def _sample_final_kernel(val_ptr, idx_ptr, out_ptr, parts, BLOCK_P: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_P)
    v = tl.load(val_ptr + row * parts + offs, mask=offs < parts, other=float("-inf"))
    top, best = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tok = tl.load(idx_ptr + row * parts + best).to(tl.int64)
    # NaN became +inf in the partial kernel; a finite row's best is finite (the noise is)
    finite = (top < float("inf")) & (top > float("-inf"))
    tl.store(out_ptr + row, tl.where(finite, tok, -1))


def sample_tokens(logits: torch.Tensor, inv_temp: float | torch.Tensor,
                  seed: int | torch.Tensor) -> torch.Tensor:
    """logits [R, V] (float32/bf16/fp16, rows contiguous); ``inv_temp``: one value for every
    row or float32 [R] on logits' device (0: greedy, else 1 / temperature); ``seed``: the
    Philox seed of the sampled rows' noise (a non-negative int32; row r draws with key
    seed + r * 2**32), or int64 [R] on logits' device: each row's own Philox key (a seeded
    request's draw then depends on its key alone, not on its row or the batch). Returns
    int64 [R]."""
    _check_logits(logits)
    rows = logits.shape[0]
    per_row = isinstance(inv_temp, torch.Tensor)
    if per_row:
        check_tensor("inv_temp", inv_temp, ndim=1, dtypes=(torch.float32,),
                     device=logits.device)
        if inv_temp.shape[0] != rows:
            raise ValueError(f"inv_temp has {inv_temp.shape[0]} values for {rows} rows")
    elif not inv_temp >= 0:  # also refuses NaN
        raise ValueError(f"inv_temp={inv_temp!r} must be >= 0 (0: greedy)")
    row_keys = isinstance(seed, torch.Tensor)
    if row_keys:
        check_tensor("seed", seed, ndim=1, dtypes=(torch.int64,), device=logits.device)
        if seed.shape[0] != rows:
            raise ValueError(f"seed has {seed.shape[0]} keys for {rows} rows")
    elif not 0 <= seed < 2**31:
        raise ValueError(f"seed={seed} must be in [0, 2**31)")
    return _launch(logits, inv_temp if per_row else None, seed if row_keys else None,
                   0.0 if per_row else float(inv_temp), 0 if row_keys else seed, None)


def _check_logits(logits: torch.Tensor) -> None:
    """What both entry points need of ``logits``: [R, V] float rows, contiguous, a
    vocabulary the kernels' split covers."""
    check_tensor("logits", logits, ndim=2,
                 dtypes=(torch.float32, torch.bfloat16, torch.float16))
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have contiguous rows (stride(1) == 1), got strides "
                         f"{tuple(logits.stride())}; pass logits.contiguous()")
    vocab = logits.shape[1]
    if triton.cdiv(vocab, BLOCK) > MAX_PARTS:
        raise ValueError(f"vocabulary {vocab} is over the kernel's limit {BLOCK * MAX_PARTS}")


def _launch(logits: torch.Tensor, inv_temp: torch.Tensor | None, keys: torch.Tensor | None,
            one_inv_temp: float, seed: int, plans: tuple | None,
            warp: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels over ``logits`` (checked by the callers): each row's token [R]."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0 or vocab == 0:
        return out.zero_()
    parts = triton.cdiv(vocab, BLOCK)
    vals = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    slots, r0, depths = plans if plans is not None else (out, out, out)
    num_plans = slots.shape[0] if plans is not None else 0
    t = depths.shape[0] if plans is not None else 0
    thr = vals if warp is None else _thresholds(logits, inv_temp, warp, slots, r0, depths)
    _sample_partial_kernel[(rows, parts)](
        logits, inv_temp if inv_temp is not None else vals,
        keys if keys is not None else out, vals, idx, vocab, parts, logits.stride(0),
        one_inv_temp, seed, slots, r0, depths, num_plans, t, thr,
        PER_ROW=inv_temp is not None and plans is None, ROW_KEYS=keys is not None,
        PLANS=plans is not None, WARP=warp is not None, BLOCK=BLOCK, num_warps=4,
        **_pdl.launch_kwargs())
    _sample_final_kernel[(rows,)](vals, idx, out, parts,
                                  BLOCK_P=max(16, triton.next_power_of_2(parts)), num_warps=1,
                                  **_pdl.launch_kwargs())
    return out


def _thresholds(logits, inv_temp, warp, slots, r0, depths) -> torch.Tensor:
    rows, vocab = logits.shape
    dev = logits.device
    parts = triton.cdiv(vocab, BLOCK)
    stats = torch.empty(rows, parts, 2, dtype=torch.float32, device=dev)
    cand = torch.empty(rows, parts, WARP_CANDIDATES, dtype=torch.float32, device=dev)
    thr = torch.empty(rows, dtype=torch.float32, device=dev)
    args = (inv_temp, warp, slots, r0, depths, slots.shape[0], depths.shape[0])
    _warp_parts_kernel[(rows, parts)](logits, stats, cand, vocab, parts, logits.stride(0),
                                      *args, BLOCK=BLOCK, M=WARP_CANDIDATES, num_warps=4,
                                      **_pdl.launch_kwargs())
    _warp_threshold_kernel[(rows,)](
        logits, thr, stats, cand, vocab, parts, logits.stride(0), *args,
        BLOCK_P=max(16, triton.next_power_of_2(parts)),
        BLOCK_C=triton.next_power_of_2(parts * WARP_CANDIDATES), M=WARP_CANDIDATES,
        BLOCK=THRESHOLD_BLOCK, WAYS=THRESHOLD_WAYS, num_warps=4, **_pdl.launch_kwargs())
    return thr


def plan_thresholds(logits: torch.Tensor, slots: torch.Tensor, r0: torch.Tensor,
                    inv_temp: torch.Tensor, warp: torch.Tensor, depths: torch.Tensor
                    ) -> torch.Tensor:
    """Each row's threshold [R] float32 on ``logits * inv_temp`` of its plan (the arguments
    of ``sample_plan_rows``): the tokens at or above it are those its plan's top-k / top-p /
    min-p keep; -inf for rows that do not warp. For tests and probes (``sample_plan_rows``
    runs the same kernel)."""
    _check_logits(logits)
    return _thresholds(logits, inv_temp, warp, slots, r0, depths)


def sample_plan_rows(logits: torch.Tensor, slots: torch.Tensor, r0: torch.Tensor,
                     inv_temp: torch.Tensor, key: torch.Tensor, depths: torch.Tensor,
                     warp: torch.Tensor | None = None) -> torch.Tensor:
    """Every row's token [R] (int64) when the rows hold speculative plans: plan e (``slots``
    [B] >= 0; -1: no plan) owns rows ``r0[e] .. r0[e] + T - 1`` (T = ``depths`` [T]); its row
    ``r0[e] + j`` draws at ``inv_temp[e]`` (float32 [B]; 0: greedy) with Philox key
    ``key[e] + depths[j] * 2**32`` where ``depths[j] >= 0``, among the tokens its
    ``warp[e]`` keeps (float32 [B, 3]: top_k (0: all), top_p, min_p, as
    ``sampler.warp_batch``; None: no plan warps). Every other row (greedy plans, rows that
    do not verify, rows of no plan) gets its argmax. The same two kernels as
    ``sample_tokens`` (and, with ``warp``, one that finds each warped row's threshold
    first); each row's program finds its plan by scanning the B plans (no launch builds
    per-row arrays first). -1 for rows that are not finite."""
    _check_logits(logits)
    dev = logits.device
    b = slots.shape[0]
    for name, t, dtype in (("slots", slots, torch.int64), ("r0", r0, torch.int64),
                           ("inv_temp", inv_temp, torch.float32), ("key", key, torch.int64)):
        check_tensor(name, t, ndim=1, dtypes=(dtype,), device=dev)
        if t.shape[0] != b:
            raise ValueError(f"{name} has {t.shape[0]} values for {b} plans")
    check_tensor("depths", depths, ndim=1, dtypes=(torch.int64,), device=dev)
    if warp is not None:
        check_tensor("warp", warp, ndim=2, dtypes=(torch.float32,), device=dev)
        if tuple(warp.shape) != (b, 3) or not warp.is_contiguous():
            raise ValueError(f"warp must be contiguous [{b}, 3], got {tuple(warp.shape)}")
    return _launch(logits, inv_temp, key, 0.0, 0, (slots, r0, depths), warp)


def sample_tokens_ref(logits: torch.Tensor, inv_temp: float | torch.Tensor,
                      gumbel: torch.Tensor) -> torch.Tensor:
    """The same rule in torch with the noise given (``gumbel`` [R, V] float32): greedy rows'
    first argmax, sampled rows' argmax of logits * inv_temp + gumbel; -1 for rows that are
    not finite."""
    x = logits.float()
    inv = (inv_temp if isinstance(inv_temp, torch.Tensor)
           else torch.full((x.shape[0],), float(inv_temp), device=x.device))[:, None]
    noisy = torch.where(x == float("-inf"), x, x * inv + gumbel.to(x.device))
    tok = torch.where(inv[:, 0] > 0, noisy.argmax(-1), x.argmax(-1))
    return tok.masked_fill(~torch.isfinite(x.amax(-1)), -1)
