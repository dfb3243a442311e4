"""Verification, one module for every proposer.

On the host, a plan's drafts are a token tree (a chain, suffix decoding's tree, lookahead's
candidates merged by prefix) verified by one walk from x (``walk_tree``): greedy, under the
request's grammar, or sampled by recursive rejection over a node's children
(``verify_position``, paper Algorithm 4); a draft model's sampled chains take the standard
rule instead (its worker's ``_rejection``).

On the device: each row's target token, greedy chain
and tree verification, the standard rule for a draft model's sampled chains, and the KV move
of accepted rows.

A row's *target* is its argmax for a greedy plan and a draw from its distribution for a
sampled one (``row_targets``: the sampling kernels; ``row_targets_torch``: the same rule as
torch ops). Accepting the longest prefix of drafts equal to their targets, then the target
after it, is exact for both (device_step's module docstring says why); a chain is verified by
``verify_chains`` (prompt lookup, a draft model's greedy plans), lookahead's tree by
``verify_tree`` (on CUDA inside ``lookahead_commit``'s kernel). A draft model's sampled
chains, whose drafts were drawn from the draft's own distribution q, take the standard rule
instead (``reject_sampled``). Lookahead's accepted rows sit at tree positions: their KV
moves to the committed indices (``move_accepted_kv``; on CUDA ``lookahead_move_kv``); a
chain's rows are in place already. Fixed shapes, no host sync, except the torch path's
sampled targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.sampler import warp, warp_batch
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative.draft import NO_WARP

if TYPE_CHECKING:
    from kiln.runtime.request import Request


@dataclass
class SpecEntries:
    """One row per possible plan of a step (device tensors, long): ``slots`` [B] (-1: no
    plan), ``q0`` [B] input row of the plan's x, ``r0`` [B] logits row of x.

    Launched ahead (the async pipeline), a step is staged before the step in flight has
    committed: its plans are laid out as if that step committed one token. ``shift`` [B]
    (1: so staged) and ``seq`` [B] (the plan's sequence in the step) let ``prologue`` move
    such a plan's positions, cache slots and context length on by the tokens the step in
    flight committed beyond one (``DeviceSpecStep.last_count``, same entry row).

    ``inv_temp`` [B] float32 (0: greedy) and ``key`` [B] long (a Philox key below 2**31):
    how each plan is verified (``verify.row_targets``); None: every plan greedy. ``warp`` [B, 3]
    float32: each plan's top_k (0: off), top_p, min_p (``NO_WARP`` where it has none);
    None: no plan warps.
    """

    slots: torch.Tensor
    q0: torch.Tensor
    r0: torch.Tensor
    shift: torch.Tensor | None = None
    seq: torch.Tensor | None = None
    inv_temp: torch.Tensor | None = None
    key: torch.Tensor | None = None
    warp: torch.Tensor | None = None


@dataclass
class StepVerdict:
    """What one verified step commits, per request of the batch.

    committed [B, N]  accepted draft tokens then the bonus token; 0 past ``count``
    count     [B]     tokens committed (1 .. N)
    src_rows  [B, N-1] in-step rows whose KV belongs at offsets 1 .. N-1 from x (the best
                      candidate's rows; only the first ``count - 1`` are moved); None for
                      a chain, whose accepted rows are in place
    """

    committed: torch.Tensor
    count: torch.Tensor
    src_rows: torch.Tensor | None


def row_targets(logits: torch.Tensor, entries: SpecEntries, offsets: torch.Tensor
                ) -> torch.Tensor:
    """Every logits row's target token [R] (the sampling kernels): its argmax (the first
    maximum), except the verification rows of sampled plans, which draw by Gumbel-max at
    the plan's ``inv_temp`` among the tokens its ``warp`` keeps. ``offsets`` [T]: each
    row's depth in its plan (its position offset from x) where the row verifies, -1 where
    it does not (lookahead's window rows keep their argmax: the Jacobi iteration is
    greedy). A row draws with Philox key ``key + depth * 2**32``: fresh noise per step and
    depth, the same for the rows of one plan at one depth. The sampling kernels find each
    row's plan themselves (``sample_plan_rows``): no launch builds per-row arrays, and a
    greedy step costs what an argmax does. No host sync (a masked bucket's graph captures
    it). A row that is not finite gives token 0 (the draw's -1, clamped: a valid id for
    the state)."""
    from kiln.runtime.kernels.sampling import sample_plan_rows

    if entries.inv_temp is None:
        return logits.argmax(-1)
    return sample_plan_rows(logits, entries.slots, entries.r0, entries.inv_temp, entries.key,
                            offsets, entries.warp).clamp_(min=0)


def gumbel_noise(key: int, depths: int, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [depths, V] from a CPU generator seeded with ``key``, row d for
    depth d (the torch path's stand-in for the kernel's Philox streams: the same key gives
    the same noise). One generator per key, not one per key + depth * 2**32: torch's CPU
    generator seeds from the low 32 bits alone, so those would all draw the same noise."""
    u = torch.rand(depths, vocab, generator=torch.Generator().manual_seed(key),
                   dtype=torch.float64)
    return -torch.log(-torch.log(u))


def row_targets_torch(logits: torch.Tensor, rows: torch.Tensor, entries: SpecEntries,
                      active: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``row_targets``' rule as torch ops on the active entries' rows ``rows`` [A, T]:
    [A, T] target tokens, with the noise of ``gumbel_noise`` (per key, a row per depth)."""
    from kiln.runtime.kernels.sampling import sample_tokens_ref

    targets = logits.argmax(-1)[rows]
    if entries.inv_temp is None:
        return targets
    inv, keys = entries.inv_temp[active].tolist(), entries.key[active].tolist()
    warps = (entries.warp[active].tolist() if entries.warp is not None
             else [NO_WARP] * len(inv))
    verifying = [(j, int(o)) for j, o in enumerate(offsets.tolist()) if o >= 0]
    depths = max(o for _, o in verifying) + 1
    for i in (i for i, v in enumerate(inv) if v > 0):
        noise = gumbel_noise(keys[i], depths, logits.shape[-1]).float()
        top_k, top_p, min_p = warps[i]
        params = SamplingParams(temperature=1.0 / inv[i], top_k=int(top_k), top_p=top_p,
                                min_p=min_p)
        for j, o in verifying:
            row = logits[rows[i, j]][None]
            if tuple(warps[i]) != NO_WARP:  # the tokens the warp drops never win
                row = row.masked_fill(warp_batch(row.float(), [params]) == 0, float("-inf"))
            tok = sample_tokens_ref(row, inv[i], noise[o : o + 1])
            targets[i, j] = tok.clamp(min=0)[0]
    return targets


def step_targets(logits: torch.Tensor, entries: SpecEntries, offsets: torch.Tensor, t: int,
                 kernels: bool) -> torch.Tensor:
    """Every plan's rows' target tokens [B, T] (``row_targets``; rows of entries without a
    plan: any row's on the kernels' path, 0 on the torch path)."""
    rows = entries.r0[:, None] + torch.arange(t, device=entries.r0.device)
    if kernels:
        targets = row_targets(logits, entries, offsets)
        return targets[rows.clamp(max=targets.shape[0] - 1)]
    a = torch.nonzero(entries.slots >= 0)[:, 0]
    out = torch.zeros_like(rows)
    out[a] = row_targets_torch(logits, rows[a], entries, a, offsets)
    return out


def verify_chains(drafts: torch.Tensor, draft_lens: torch.Tensor, argmax: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain verification for a batch: argmax [B, D+1] holds the model's token after
    each draft prefix. Returns (accepted [B, D+1] long, 0 past counts, counts [B] long)."""
    d = drafts.shape[1]
    idx = torch.arange(d + 1, device=argmax.device)
    ok = (argmax[:, :d] == drafts) & (idx[None, :d] < draft_lens[:, None])
    num_matched = ok.long().cumprod(dim=1).sum(dim=1)
    # accepted drafts equal argmax at their rows, and the bonus token is argmax[num_matched]
    accepted = torch.where(idx[None, :] <= num_matched[:, None], argmax.long(), 0)
    return accepted, num_matched + 1


def verify_tree(tokens: torch.Tensor, argmax: torch.Tensor, valid: torch.Tensor,
                cand_rows: torch.Tensor, n: int) -> StepVerdict:
    """Greedy verification of a lookahead step (the host's ``walk_tree`` over the
    candidates, per row): the longest matching valid candidate (first on ties), its matched
    tokens plus the bonus. ``tokens`` [B, T] the step's input ids, ``argmax`` [B, T] each
    row's target, ``valid`` [B, G] real candidates, ``cand_rows`` [G, N-1] the candidates'
    in-step rows."""
    b, n1 = tokens.shape[0], n - 1
    g = cand_rows.shape[0]
    dev = tokens.device
    x_next = argmax[:, 0]
    if not g:
        committed = torch.zeros(b, n, dtype=torch.long, device=dev)
        committed[:, 0] = x_next
        return StepVerdict(committed, torch.ones(b, dtype=torch.long, device=dev),
                           torch.zeros(b, n1, dtype=torch.long, device=dev))
    cand = tokens[:, cand_rows]  # [B, G, N-1]
    after = argmax[:, cand_rows]  # model's token after each candidate token
    target = torch.cat([x_next[:, None, None].expand(-1, g, 1), after[:, :, :-1]], 2)
    match = (cand == target) & valid[:, :, None]
    mlen = match.long().cumprod(2).sum(2)  # [B, G]
    best = mlen.argmax(1)  # first of the longest
    m = mlen.gather(1, best[:, None])[:, 0]
    best_cand = cand[torch.arange(b, device=dev), best]  # [B, N-1]
    best_after = after[torch.arange(b, device=dev), best]
    bonus = torch.where(m > 0, best_after.gather(1, (m - 1).clamp(min=0)[:, None])[:, 0],
                        x_next)
    k = torch.arange(n, device=dev)[None, :]
    padded = torch.cat([best_cand, torch.zeros(b, 1, dtype=torch.long, device=dev)], 1)
    committed = torch.where(k < m[:, None], padded,
                            torch.where(k == m[:, None], bonus[:, None], 0))
    return StepVerdict(committed, m + 1, cand_rows[best])


def verify_position(
    p: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None = None
) -> tuple[int, int | None]:
    """Sampling verification at one position (paper Algorithm 4, LOOKAHEAD.md step 6).

    p: [V] target probabilities (already warped: temperature/top-k/top-p). Try drafts in
    order: accept draft d with probability p(d) / sum(p) (p renormalised over what is left);
    on rejection set p(d) = 0 and try the next; all rejected -> sample from the remainder.
    Returns (token, index of the accepted draft or None). The output is distributed as p.
    """
    if p.dim() != 1:
        raise ValueError(f"verify_position expects p of shape [V], got {tuple(p.shape)}")
    # One uniform per draft plus one for the residual sample, drawn up front, on the CPU
    # (a seeded request's generator). The vocabulary stays a tensor where p is: two small
    # reads (the drafts' masses and the total; the residual's token), not a Python walk
    # over every token (2.7-3 ms per call at a 49152 vocabulary).
    u = torch.rand(len(drafts) + 1, generator=generator, dtype=torch.float64).tolist()
    q = p.detach().to(torch.float64)
    head = q.new_tensor([int(d) for d in drafts], dtype=torch.long)
    *masses, total = torch.cat([q[head], q.sum()[None]]).tolist()
    rejected: dict[int, None] = {}
    for idx, d in enumerate(drafts):
        if total <= 0.0:
            break
        mass = 0.0 if d in rejected else masses[idx]
        if u[idx] * total < mass:  # accept with probability q(d) / sum(q)
            return int(d), idx
        if d not in rejected:
            rejected[d] = None
            total -= mass
    if rejected and total > 0.0:
        q = q.index_fill(0, q.new_tensor(list(rejected), dtype=torch.long), 0.0)
    elif rejected:
        # every token with mass was a rejected draft (only possible through rounding)
        total = float(q.sum())
    if not total > 0.0:
        return int(p.argmax()), None  # no mass at all (the sampler's rule for such rows)
    # the first token whose running mass passes u * total; tokens without mass never do
    cum = q.cumsum(0)
    tok = int(torch.searchsorted(cum, cum.new_tensor([u[-1] * total]), right=True)[0])
    if tok >= q.shape[0]:  # rounding past the end: the last token with mass
        tok = int(torch.nonzero(q > 0)[-1, 0])
    return tok, None


def walk_tree(req: Request, logits: torch.Tensor, argmax: list[int],
              kids: dict[int, dict[int, int]]) -> tuple[list[int], list[tuple[int, int]], int]:
    """Verify a token tree of drafts in one walk from x (row 0): at each row the target's
    token (greedy: ``argmax[row]``; under the request's grammar: the argmax of what it
    allows after the tokens before, the choice plain guided decoding makes; sampled: paper
    Algorithm 4 over the row's children, ``verify_position``, whose token is distributed as
    the target's at the row), on to the child holding it (``kids[row]``: children's rows
    by token) while one does, then that token as the bonus. A draft that completes the
    grammar ends the walk (nothing may follow its stop token); the matcher is left as it
    was. Returns (committed tokens, KV moves (row, offset from x) of the accepted drafts
    whose rows are not their offsets, drafts accepted)."""
    matcher = req.matcher
    if matcher is not None:
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)

        def pick(row: int, drafts: list[int]) -> int:
            mask.zero_()
            matcher.fill_mask(mask)
            return int(logits[row].masked_fill(~mask.to(logits.device), float("-inf")).argmax())
    elif req.params.greedy:
        def pick(row: int, drafts: list[int]) -> int:
            return argmax[row]
    else:
        def pick(row: int, drafts: list[int]) -> int:
            return verify_position(warp(logits[row], req.params), drafts, req.generator)[0]

    accepted: list[int] = []
    moves: list[tuple[int, int]] = []
    row = matched = 0
    try:
        while True:
            below = kids.get(row, {})
            tok = pick(row, list(below))
            accepted.append(tok)
            nxt = below.get(tok)
            if nxt is None or (matcher is not None and not matcher.accept(tok)):
                return accepted, moves, matched
            matched += 1
            if nxt != matched:  # its KV was written at its row's index
                moves.append((nxt, matched))
            if matcher is not None and matcher.is_terminated():
                return accepted, moves, matched
            row = nxt
    finally:
        if matcher is not None and matched:
            matcher.rollback(matched)


def accept_drafts(u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """The standard rule's acceptances [m, K] (bool): draft i is accepted with probability
    min(1, p_i(d) / q_i(d)), i.e. when u * q < p for u ~ U(0, 1)."""
    return u * q_d < p_d


def reject_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                   drew: torch.Tensor | None, u: torch.Tensor, noise: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard rule (Leviathan et al. 2023; Chen et al. 2023) for m sampled chains of K
    drafts: accept draft i with probability min(1, p_i(d) / q_i(d)); at the first rejection
    draw from norm(max(0, p_i - q_i)), after K acceptances from p_K, by an exponential race.
    ``p`` [m, K+1, V] the target's probabilities at x and after each draft, ``q`` [m, K, V]
    the draft's, ``drafts`` [m, K], ``drew`` [m] float32 (0: the chain's draft failed, it
    accepts nothing; None: every chain drew), ``u`` [m, K] uniforms, ``noise`` [m, V] the
    races' exponential noise. Returns (committed [m, K+1]: accepted drafts then the drawn
    token, 0 past it; count [m]). No host sync."""
    m, k = drafts.shape
    dev = p.device
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]
    if drew is not None:  # no draft is accepted (u * 0 < 0 never holds)
        p_d = p_d * drew[:, None]
    q_d = q.gather(2, drafts[..., None])[..., 0]
    a = accept_drafts(u, p_d, q_d).long().cumprod(1).sum(1)  # accepted, 0..K
    idx = torch.arange(m, device=dev)
    p_a = p[idx, a]
    resid = (p_a - q[idx, a.clamp(max=k - 1)]).clamp_(min=0)
    resid = torch.where((a < k)[:, None], resid, p_a)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_a)  # p == q to rounding
    t = (resid / noise).argmax(-1)
    col = torch.arange(k + 1, device=dev)[None, :]
    d_pad = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1)
    committed = torch.where(col < a[:, None], d_pad,
                            torch.where(col == a[:, None], t[:, None], 0))
    return committed, a + 1


def move_accepted_kv(cache: KVCache, slot_mapping: torch.Tensor, q0: torch.Tensor,
                     count: torch.Tensor, src_rows: torch.Tensor) -> None:
    """``lookahead_move_kv`` as torch ops: the KV of accepted draft k (input row
    ``q0 + src_rows[k]``) moves to x's index + 1 + k (input row ``q0 + 1 + k``); rows not
    accepted are copied onto themselves. ``count`` [B], ``src_rows`` [B, N-1]: a verdict's."""
    n1 = src_rows.shape[1]
    k = torch.arange(n1, device=q0.device)
    dst_rows = q0[:, None] + 1 + k
    src = torch.where(k < count[:, None] - 1, q0[:, None] + src_rows, dst_rows)
    sm = slot_mapping.long()
    cache.move_slots(sm[src.reshape(-1)], sm[dst_rows.reshape(-1)])
