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


# The seed changes every step: never a specialisation (a seed divisible by 16, as greedy's 0,
# compiled another variant, a ~0.5 s stall at the first sampled request).
@triton.jit(do_not_specialize=["seed", "num_plans"])
def _sample_partial_kernel(
    logits_ptr, inv_temp_ptr, key_ptr, val_ptr, idx_ptr, V, parts, stride_r, inv_temp, seed,
    plan_slot_ptr, plan_r0_ptr, depth_ptr, num_plans, T,
    PER_ROW: tl.constexpr, ROW_KEYS: tl.constexpr, PLANS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
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
        x = x * inv_temp - tl.log(-tl.log(u))
    # one reduction for both (tl.argmax is this call, keeping only the index)
    best, arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * parts + part, best)
    tl.store(idx_ptr + row * parts + part, part * BLOCK + arg)


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
            one_inv_temp: float, seed: int, plans: tuple | None) -> torch.Tensor:
    """The two kernels over ``logits`` (checked by the callers): each row's token [R]."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0 or vocab == 0:
        return out.zero_()
    parts = triton.cdiv(vocab, BLOCK)
    vals = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    slots, r0, depths = plans if plans is not None else (out, out, out)
    _sample_partial_kernel[(rows, parts)](
        logits, inv_temp if inv_temp is not None else vals,
        keys if keys is not None else out, vals, idx, vocab, parts, logits.stride(0),
        one_inv_temp, seed, slots, r0, depths, slots.shape[0] if plans is not None else 0,
        depths.shape[0] if plans is not None else 0,
        PER_ROW=inv_temp is not None and plans is None, ROW_KEYS=keys is not None,
        PLANS=plans is not None, BLOCK=BLOCK, num_warps=4, **_pdl.launch_kwargs())
    _sample_final_kernel[(rows,)](vals, idx, out, parts,
                                  BLOCK_P=max(16, triton.next_power_of_2(parts)), num_warps=1,
                                  **_pdl.launch_kwargs())
    return out


def sample_plan_rows(logits: torch.Tensor, slots: torch.Tensor, r0: torch.Tensor,
                     inv_temp: torch.Tensor, key: torch.Tensor, depths: torch.Tensor
                     ) -> torch.Tensor:
    """Every row's token [R] (int64) when the rows hold speculative plans: plan e (``slots``
    [B] >= 0; -1: no plan) owns rows ``r0[e] .. r0[e] + T - 1`` (T = ``depths`` [T]); its row
    ``r0[e] + j`` draws at ``inv_temp[e]`` (float32 [B]; 0: greedy) with Philox key
    ``key[e] + depths[j] * 2**32`` where ``depths[j] >= 0``. Every other row (greedy plans,
    rows that do not verify, rows of no plan) gets its argmax. The same two kernels as
    ``sample_tokens``; each row's program finds its plan by scanning the B plans (no launch
    builds per-row arrays first). -1 for rows that are not finite."""
    _check_logits(logits)
    dev = logits.device
    b = slots.shape[0]
    for name, t, dtype in (("slots", slots, torch.int64), ("r0", r0, torch.int64),
                           ("inv_temp", inv_temp, torch.float32), ("key", key, torch.int64)):
        check_tensor(name, t, ndim=1, dtypes=(dtype,), device=dev)
        if t.shape[0] != b:
            raise ValueError(f"{name} has {t.shape[0]} values for {b} plans")
    check_tensor("depths", depths, ndim=1, dtypes=(torch.int64,), device=dev)
    return _launch(logits, inv_temp, key, 0.0, 0, (slots, r0, depths))


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
