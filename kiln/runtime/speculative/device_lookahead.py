"""Lookahead's device proposer: its state and step logic as batched tensor ops.

The same algorithm as the host worker (lookahead.py with lookahead_math.py, the oracle),
kept per request *slot* in device tensors so a speculative step can be proposed, verified
and folded back into the state without the host:

    window  [S, L, W]        the Jacobi window (L = N-1 levels; level 0 col 0 is x)
    keys    [S, H, G]        the n-gram pool's table (``NgramPool``'s definition): bucket
    conts   [S, H, G, N-1]   ``key % H``, G entries per bucket (key -1: empty), a write
    cursor  [S, H]           cursor per bucket, deduplicated inserts
    recent  [S, N-1]         the last N-1 committed tokens (x last; -1 before the prompt)
    total   [S]              committed tokens so far (prompt included)
    history [S, C] int32     those tokens (C = max_seq_len + T): the prompt-lookup
                             candidate's text (``find_drafts``, as prompt lookup's device state)

One step of a batch of slots, for the engine's window (W, N, G) at fixed T = (W+G)(N-1)
(candidate slots a bucket does not fill are padded and never accepted; the prompt-lookup
candidate, the continuation of the latest earlier match of the slot's last tokens, takes
the slot after the pool's candidates, the last one when they fill all G: ``with_lookup``):

    tokens, valid = state.propose(slots)              # the step's input ids [B, T]
    ... forward with step_layout(W, N, G)'s mask; argmax of every row [B, T] ...
    out = state.verify(tokens, argmax, valid)         # committed [B, N], count [B], KV rows
    state.update(slots, tokens, argmax, out)          # window shift, pool inserts, recent

Everything is tensor ops with fixed shapes and no host sync (no ``.item()``, no
data-dependent shapes): the reference of the Triton kernels (kiln/runtime/kernels/
lookahead.py), which run the same step on CUDA (``DeviceProposer.propose_step`` /
``commit_step``: the kernels, or these ops, chosen at construction).
Verification compares drafts with each row's target token (``argmax`` below): the argmax
for greedy requests, a draw for sampled ones (verify.row_targets; the lookahead
branch's rows always hold their argmax).
"""

from __future__ import annotations

import torch

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.host_copy import to_device
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.speculative.device_ngram import find_drafts
from kiln.runtime.speculative.device_step import DeviceProposer, Proposal
from kiln.runtime.speculative.lookahead_math import (
    POOL_BUCKETS,
    NgramPool,
    initial_window,
    step_layout,
)
from kiln.runtime.speculative.verify import SpecEntries, StepVerdict, move_accepted_kv, verify_tree


class DeviceLookahead(DeviceProposer):
    """Lookahead windows and n-gram pools of ``num_slots`` requests, one window (W, N, G)."""

    name = "lookahead"

    def __init__(self, num_slots: int, window: tuple[int, int, int], device: torch.device,
                 buckets: int = POOL_BUCKETS, match: tuple[int, int] = (3, 1),
                 capacity: int = 4096):
        w, n, g = window
        if n < 2:
            raise ValueError(f"device lookahead needs n >= 2, got window {window}")
        self.w, self.n, self.g, self.buckets = w, n, g, buckets
        self.max_match, self.min_match = match
        self.capacity = capacity
        self.window_size = (w, n, g)
        self.levels = n - 1
        layout = step_layout(w, n, g)
        # the depth of the rows that verify (x, the candidates' tokens), -1 for the
        # window's rows: sampled plans draw there (verify.row_targets)
        offs = torch.full((layout.num_tokens,), -1, dtype=torch.long)
        verifying = torch.cat([torch.zeros(1, dtype=torch.long), layout.candidate_rows.reshape(-1)])
        offs[verifying] = layout.position_offsets[verifying]
        super().__init__(num_slots, layout.num_tokens, n, offs, device)
        self.window_rows = layout.window_rows.to(self.device)  # [L, W]
        self.last_rows = layout.last_level_rows.to(self.device)  # [W]
        self.cand_rows = layout.candidate_rows.to(self.device)  # [G, N-1]
        dev, long = self.device, torch.long
        self.window = torch.zeros(num_slots, self.levels, w, dtype=long, device=dev)
        self.keys = torch.full((num_slots, buckets, max(g, 1)), -1, dtype=long, device=dev)
        self.conts = torch.zeros(num_slots, buckets, max(g, 1), n - 1, dtype=long, device=dev)
        self.cursor = torch.zeros(num_slots, buckets, dtype=long, device=dev)
        self.recent = torch.full((num_slots, n - 1), -1, dtype=long, device=dev)
        self.total = torch.zeros(num_slots, dtype=long, device=dev)
        self.history = torch.zeros(num_slots, capacity, dtype=torch.int32, device=dev)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, num_slots: int, max_seq_len: int,
                    device: torch.device) -> DeviceLookahead | None:
        """The engine's window's slots; None for N < 2 (no levels to keep on the device)."""
        if spec.lookahead[1] < 2:
            return None
        return cls(num_slots, spec.lookahead, device,
                   match=(spec.ngram_max_match, spec.ngram_min_match),
                   capacity=max_seq_len + spec.tokens_per_step)

    def use_kernels(self, on: bool) -> None:
        super().use_kernels(on)
        if on:  # Triton is imported by the engines that run the kernels only
            from kiln.runtime.kernels import lookahead as kernels

            self._k = kernels

    def admit(self, slot: int, prompt: list[int], seed: int | None) -> None:
        """A request's first window (``initial_window``) and its pool seeded with the
        prompt's n-grams, into ``slot`` (``load``)."""
        pool = NgramPool(self.n, self.g, self.buckets)
        pool.seed_from_tokens(prompt)
        self.load(slot, initial_window(prompt, self.w, self.n, seed), pool, prompt)

    def warm(self) -> None:
        """``fold``'s kernel (it runs outside the graphs, on a request's next proposal),
        launched once on no slot (it writes nothing)."""
        if not self.kernels:
            return
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self.fold(torch.full((1,), -1, dtype=torch.long, device=self.device),
                  torch.zeros(1, 3, dtype=torch.long, device=self.device), zero)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def propose_step(self, entries: SpecEntries, input_ids: torch.Tensor) -> Proposal:
        if self.kernels:
            return Proposal(*self._k.lookahead_propose(
                entries.slots, self.window, self.keys, self.conts, self.cursor, self.recent,
                self.total, self.history, self.g, (self.max_match, self.min_match),
                input_ids, entries.q0))
        return self._propose_active(entries, input_ids, self.propose)

    def commit_step(self, entries: SpecEntries, proposal: Proposal, targets: torch.Tensor,
                    slot_mapping: torch.Tensor, cache: KVCache
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree verification (``verify``), the state update (``update``) and the KV move
        of the best candidate's accepted rows."""
        if self.kernels:
            committed, count, src_rows = self._k.lookahead_commit(
                entries.slots, proposal.tokens, targets, proposal.valid, self.window,
                self.keys, self.conts, self.cursor, self.recent, self.total, self.history,
                self.window_rows, self.last_rows, self.cand_rows)
            self._k.lookahead_move_kv(cache.k, cache.v, slot_mapping, entries.q0, count,
                                      src_rows)
            return committed, count
        a = proposal.active
        argmax = targets[a]
        verdict = self.verify(proposal.tokens, argmax, proposal.valid)
        self.update(entries.slots[a], proposal.tokens, argmax, verdict)
        move_accepted_kv(cache, slot_mapping, entries.q0[a], verdict.count, verdict.src_rows)
        return self._scatter(entries, a, verdict.committed, verdict.count)

    # -- admission (host side, once per request) --------------------------------------------
    def load(self, slot: int, window: list[list[int]], pool: NgramPool,
             tokens: list[int]) -> None:
        """Load a request's initial state into ``slot``: its window grid ``[L][W]``, its
        seeded host pool (the same table definition) and its tokens so far (prompt).

        Only the pool's filled entries travel (one pinned copy with the window and the
        recent tokens): the slot's keys are reset to empty and its cursors to 0 on the
        device, and the entries scattered in. Continuations of empty cells are never read
        (no key matches -1). Building the dense [4096, 7, 6] table of a (7,7,7) engine on
        the host and copying it (pageable, so each copy waited for the stream) cost 1.3-1.9
        ms per request with a 60-token prompt and 21-22 ms with a 1000-token one (CPU);
        this costs 0.3 and 5-8 ms."""
        if (pool.n, pool.g, pool.buckets) != (self.n, self.g, self.buckets):
            raise ValueError(f"pool (n={pool.n}, g={pool.g}, buckets={pool.buckets}) does not "
                             f"match the device table (n={self.n}, g={self.g}, "
                             f"buckets={self.buckets})")
        if not 0 < len(tokens) <= self.capacity:
            raise ValueError(f"{len(tokens)} tokens do not fit a device lookahead slot of "
                             f"{self.capacity}")
        flat, keys, conts, cursors = pool.entries()
        n1 = self.n - 1
        recent = ([-1] * n1 + list(tokens))[-n1:]
        parts = [[t for row in window for t in row], recent, flat, keys,
                 [t for c in conts for t in c], [h for h, _ in cursors],
                 [c for _, c in cursors], tokens]
        packed = to_device([t for part in parts for t in part], torch.long, self.device)
        win, rec, at, key, cont, bucket, cur, hist = packed.split([len(p) for p in parts])
        self.history[slot, : len(tokens)] = hist.to(torch.int32)
        self.window[slot] = win.view(self.levels, self.w)
        self.recent[slot] = rec
        self.keys[slot].fill_(-1)
        self.cursor[slot].zero_()
        if flat:
            self.keys[slot].view(-1)[at] = key
            self.conts[slot].view(-1, n1)[at] = cont.view(-1, n1)
            self.cursor[slot][bucket] = cur
        self.total[slot] = len(tokens)

    # -- one step --------------------------------------------------------------------------
    def _bucket(self, slots: torch.Tensor, key: torch.Tensor):
        """Bucket index, entries (keys [B, G], conts [B, G, N-1]) and cursor of ``key``."""
        h = key % self.buckets
        return h, self.keys[slots, h], self.conts[slots, h], self.cursor[slots, h]

    def propose(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's input ids [B, T] (x, the window, G candidate slots) and which
        candidate slots hold a real candidate [B, G] (the pool's entries of x, most recent
        first, as ``NgramPool.candidates``; the rest repeat x and are never accepted)."""
        x = self.recent[slots, -1]
        b = slots.shape[0]
        win = self.window[slots]
        parts = [x[:, None], win[:, 0, 1:], win[:, 1:].reshape(b, -1)]
        valid = torch.zeros(b, self.g, dtype=torch.bool, device=self.device)
        if self.g:
            _, keys, conts, cursor = self._bucket(slots, x)
            g = self.g
            order = (cursor[:, None] - 1 - torch.arange(g, device=self.device)) % g
            keys = keys.gather(1, order)
            conts = conts.gather(1, order[:, :, None].expand(-1, -1, self.n - 1))
            hit = keys == x[:, None]
            # stable compaction: matching entries first, in recency order
            pos = torch.sort((~hit).to(torch.int8), dim=1, stable=True).indices
            valid = hit.gather(1, pos)
            cands = conts.gather(1, pos[:, :, None].expand(-1, -1, self.n - 1))
            cands = torch.where(valid[:, :, None], cands, x[:, None, None])
            cands, valid = self._with_lookup(slots, cands, valid)
            parts.append(cands.reshape(b, -1))
        return torch.cat(parts, dim=1), valid

    def _with_lookup(self, slots: torch.Tensor, cands: torch.Tensor, valid: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``with_lookup`` on the pool's compacted candidates [B, G, N-1] and ``valid``
        [B, G]: the prompt-lookup draft (0 past its end) in slot min(#valid, G-1), unless
        it is empty or equals a valid candidate."""
        drafts, lens = find_drafts(self.history[slots], self.total[slots], self.max_match,
                                   self.min_match, self.n - 1)
        dup = (valid & (cands == drafts[:, None, :]).all(2)).any(1)
        use = (lens > 0) & ~dup
        at = valid.sum(1).clamp(max=self.g - 1)
        rows = torch.arange(slots.shape[0], device=self.device)
        cands = cands.clone()
        cands[rows, at] = torch.where(use[:, None], drafts, cands[rows, at])
        valid = valid.clone()
        valid[rows, at] |= use
        return cands, valid

    def verify(self, tokens: torch.Tensor, argmax: torch.Tensor,
               valid: torch.Tensor) -> StepVerdict:
        """Greedy tree verification of a step (``verify.verify_tree``)."""
        return verify_tree(tokens, argmax, valid, self.cand_rows, self.n)

    def update(self, slots: torch.Tensor, tokens: torch.Tensor, argmax: torch.Tensor,
               verdict: StepVerdict) -> None:
        """Fold a verified step into the slots' state, as the host worker does: insert the
        lookahead branch's W n-grams, then the committed tokens (``commit_tokens``); shift
        the window one level (the top level takes the new tokens)."""
        b, n1 = tokens.shape[0], self.n - 1
        new = argmax[:, self.last_rows]  # [B, W]
        chains = tokens[:, self.window_rows].transpose(1, 2)  # [B, W, L]
        grams = torch.cat([chains[:, :, :n1], new[:, :, None]], 2)  # [B, W, N]
        self._insert(slots, grams, torch.ones(b, self.w, dtype=torch.bool, device=self.device))
        self.commit_tokens(slots, verdict.committed, verdict.count)
        win = self.window[slots]
        if self.levels > 1:
            shifted = torch.cat([win[:, 1:2], win[:, 2:], new[:, None]], 1)
        else:
            shifted = new[:, None].clone()
        shifted[:, 0, 0] = 0  # level 0 col 0 is x, refreshed at every proposal
        self.window[slots] = shifted

    def commit_tokens(self, slots: torch.Tensor, tokens: torch.Tensor,
                      count: torch.Tensor) -> None:
        """Tokens committed to the slots' requests (``tokens[b, :count[b]]``, any width K):
        insert the n-gram ending at each (once the history holds N tokens), as the host
        worker's ``on_commit``; advance ``recent`` and ``total``. Verified steps call it
        through ``update``; plain steps of a speculating request call it directly."""
        n, n1 = self.n, self.n - 1
        dev = self.device
        k_max = tokens.shape[1]
        seq = torch.cat([self.recent[slots], tokens.long()], 1)  # [B, N-1+K]
        ends = torch.arange(k_max, device=dev)
        idx = ends[:, None] + torch.arange(n, device=dev)[None, :]  # n-gram e = seq[e : e+N]
        grams = seq[:, idx]  # [B, K, N]
        ok = (ends[None, :] < count[:, None]) & (grams >= 0).all(2)
        self._insert(slots, grams, ok)
        take = count[:, None] + torch.arange(n1, device=dev)[None, :]
        self.recent[slots] = seq.gather(1, take)
        at = (self.total[slots][:, None] + ends[None, :]).clamp(max=self.capacity - 1)
        keep = ends[None, :] < count[:, None]
        old = self.history[slots[:, None], at]
        self.history[slots[:, None], at] = torch.where(keep, tokens.to(torch.int32), old)
        self.total[slots] += count

    def fold(self, slots: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> None:
        """``commit_tokens`` of the tokens plain steps committed: one kernel
        (``lookahead_fold``), or the torch ops."""
        if self.kernels:
            self._k.lookahead_fold(slots, tokens, count, self.keys, self.conts, self.cursor,
                                   self.recent, self.total, self.history, self.g)
        else:
            self.commit_tokens(slots, tokens, count)

    def _insert(self, slots: torch.Tensor, grams: torch.Tensor, ok: torch.Tensor) -> None:
        """Insert n-grams [B, K, N] (``ok`` [B, K]) in order k = 0 .. K-1, each one as
        ``NgramPool.add``: skipped when its bucket holds it, else written at the cursor."""
        if not self.g:
            return
        rows = torch.arange(slots.shape[0], device=self.device)
        for k in range(grams.shape[1]):
            key, cont = grams[:, k, 0], grams[:, k, 1:]
            h, keys, conts, cursor = self._bucket(slots, key)
            dup = ((keys == key[:, None]) & (conts == cont[:, None, :]).all(2)).any(1)
            write = ok[:, k] & ~dup
            old_key = keys[rows, cursor]
            old_cont = conts[rows, cursor]
            self.keys[slots, h, cursor] = torch.where(write, key, old_key)
            self.conts[slots, h, cursor] = torch.where(write[:, None], cont, old_cont)
            self.cursor[slots, h] = torch.where(write, (cursor + 1) % self.g, cursor)
