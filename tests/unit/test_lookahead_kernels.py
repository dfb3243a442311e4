"""Lookahead step kernels (kiln/runtime/kernels/lookahead.py) vs the torch ops they replace
(DeviceLookahead.propose / verify / update), on Triton's CPU interpreter.

Two identical DeviceLookahead states run the same steps side by side, one through the torch
ops and one through the kernels, with a stand-in model whose greedy token after any row is
a bigram table of that row's token (so the pool learns chains and candidates get accepted).
After every step the proposal, the verdict and every state tensor must be equal exactly.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import random

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.kernels.lookahead import lookahead_commit, lookahead_propose
from kiln.runtime.speculative.device_lookahead import DeviceLookahead
from kiln.runtime.speculative.lookahead_math import NgramPool
from kiln.runtime.speculative.verify import StepVerdict

STATE = ("window", "keys", "conts", "cursor", "recent", "total", "history")
NUM_SLOTS = 5
SLOTS = [3, 0, 4]  # slots 1 and 2 stay idle: the kernels must not touch them


def propose(st, slots, *io):
    """``lookahead_propose`` on ``st``'s tensors (``io``: input_ids, q0)."""
    return lookahead_propose(slots, st.window, st.keys, st.conts, st.cursor, st.recent,
                             st.total, st.history, st.g, (st.max_match, st.min_match), *io)


def commit(st, slots, tokens, argmax, valid):
    """``lookahead_commit`` on ``st``'s tensors and step layout."""
    return lookahead_commit(slots, tokens, argmax, valid, st.window, st.keys, st.conts,
                            st.cursor, st.recent, st.total, st.history, st.window_rows,
                            st.last_rows, st.cand_rows)


def make_states(window, buckets, rng, vocab):
    w, n, g = window
    ref = DeviceLookahead(NUM_SLOTS, window, torch.device("cpu"), buckets=buckets)
    # prompts of 1 token (recent starts with -1s), a few, and many (full buckets)
    for slot, length in zip(range(NUM_SLOTS), (1, 3, 9, 30, 12)):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        pool = NgramPool(n, g, buckets=buckets)
        pool.seed_from_tokens(prompt)
        grid = [[rng.randrange(vocab) for _ in range(w)] for _ in range(n - 1)]
        ref.load(slot, grid, pool, prompt)
    dut = DeviceLookahead(NUM_SLOTS, window, torch.device("cpu"), buckets=buckets)
    for name in STATE:
        getattr(dut, name).copy_(getattr(ref, name))
    return ref, dut


def assert_same_state(ref, dut, where):
    for name in STATE:
        a, b = getattr(ref, name), getattr(dut, name)
        assert torch.equal(a, b), (where, name, (a != b).nonzero()[:8].tolist())


def lockstep(ref, dut, slots, model, steps):
    """Run ``steps`` steps through the torch ops (ref) and the kernels (dut); compare every
    output and every state tensor after each. Returns the torch verdicts."""
    verdicts = []
    for step in range(steps):
        tokens, valid = ref.propose(slots)
        k_tokens, k_valid = propose(dut, slots)
        assert torch.equal(tokens, k_tokens), step
        assert torch.equal(valid, k_valid), step
        assert_same_state(ref, dut, (step, "propose"))
        argmax = model(tokens, step)
        verdict = ref.verify(tokens, argmax, valid)
        ref.update(slots, tokens, argmax, verdict)
        k_verdict = StepVerdict(*commit(dut, slots, k_tokens, argmax, k_valid))
        assert torch.equal(verdict.committed, k_verdict.committed), step
        assert torch.equal(verdict.count, k_verdict.count), step
        assert torch.equal(verdict.src_rows, k_verdict.src_rows), step
        assert_same_state(ref, dut, (step, "commit"))
        verdicts.append(verdict)
    return verdicts


@pytest.mark.parametrize("window", [(4, 4, 4), (7, 7, 7), (2, 2, 1), (3, 3, 0), (5, 3, 2)])
@pytest.mark.parametrize("buckets", [4096, 5])
def test_kernel_steps_equal_the_torch_ops(window, buckets):
    rng = random.Random(window[0] * 1000 + window[1] * 100 + window[2] * 10 + buckets)
    vocab = 10
    bigram = torch.tensor([rng.randrange(vocab) for _ in range(vocab)])
    noise = {t: rng.randrange(vocab) for t in range(vocab) if rng.random() < 0.2}

    def model(tokens, step):
        out = bigram[tokens]
        if step % 2:  # noisy tokens answer differently on odd steps
            for t, v in noise.items():
                out = torch.where(tokens == t, v, out)
        return out

    ref, dut = make_states(window, buckets, rng, vocab)
    verdicts = lockstep(ref, dut, torch.tensor(SLOTS), model, steps=10)
    accepted = sum(int((v.count - 1).sum()) for v in verdicts)
    if window[2]:  # the comparison covered accepted drafts, not only bonus tokens
        assert accepted > 0


def test_ties_go_to_the_first_longest_candidate():
    """x = 1's candidates, most recent first: (2,6,7) (2,3,5) (2,3,4); the model's chain is
    1 -> 2 -> 3 -> 9, so the last two tie at 2 matched tokens and the first of them wins."""
    window, buckets = (3, 4, 4), 5
    bigram = torch.tensor([4, 2, 3, 9, 6, 0, 7, 1, 5, 8])
    states = []
    for _ in range(2):
        st = DeviceLookahead(2, window, torch.device("cpu"), buckets=buckets)
        pool = NgramPool(4, 4, buckets=buckets)
        for gram in ((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 6, 7), (6, 0, 7, 1)):  # 6: bucket 1
            pool.add(gram)
        st.load(1, [[5, 8, 0], [6, 2, 7], [3, 3, 9]], pool, [8, 1])
        states.append(st)
    verdicts = lockstep(*states, torch.tensor([1]), lambda t, _: bigram[t], steps=3)
    assert verdicts[0].committed.tolist() == [[2, 3, 9, 0]]
    assert verdicts[0].src_rows.tolist() == [states[0].cand_rows[1].tolist()]


def test_commit_accepts_int32_argmax_and_strided_rows():
    rng = random.Random(7)
    ref, dut = make_states((3, 4, 3), 5, rng, 6)
    slots = torch.tensor([2, 4])
    for step in range(4):
        tokens, valid = ref.propose(slots)
        k_tokens, k_valid = propose(dut, slots)
        argmax = (tokens * 5 + 1) % 6
        ref.update(slots, tokens, argmax, ref.verify(tokens, argmax, valid))
        wide = torch.zeros(2, tokens.shape[1] + 3, dtype=torch.int32)
        wide[:, : tokens.shape[1]] = argmax
        commit(dut, slots, k_tokens, wide[:, : tokens.shape[1]], k_valid)
        assert_same_state(ref, dut, step)


def test_empty_batch_and_bad_arguments():
    dut = DeviceLookahead(2, (2, 3, 2), torch.device("cpu"), buckets=5)
    tokens, valid = propose(dut, torch.empty(0, dtype=torch.long))
    assert tokens.shape == (0, dut.num_tokens) and valid.shape == (0, 2)
    committed, _, _ = commit(dut, torch.empty(0, dtype=torch.long), tokens, tokens, valid)
    assert committed.shape == (0, 3)
    with pytest.raises(ValueError, match="tokens has shape"):
        commit(dut, torch.tensor([0]), tokens, tokens, valid)
    with pytest.raises(ValueError, match="slots has dtype"):
        propose(dut, torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("window,layout", [((4, 4, 4), "NHD"), ((1, 3, 2), "HND"),
                                           ((3, 3, 0), "HND")])
def test_device_spec_step_kernels_equal_its_torch_path(window, layout):
    """DeviceSpecStep (what a masked bucket's graph runs around its forward) through the
    kernels (proposal into the input ids, commit, KV move) and through the torch ops, over
    entries with spare rows (slot -1) between them, on a real KV cache (the kernels' in
    ``layout``, the torch ops' NHD): the same input ids, commits, state and cache after every
    step. (1,3,2) puts candidate rows right after x, so a move's source is another move's
    destination."""
    from kiln.runtime.kv_cache import KVCache
    from kiln.runtime.speculative.device_step import DeviceSpecStep, SpecEntries

    rng = random.Random(sum(window))
    vocab = 10
    bigram = torch.tensor([rng.randrange(vocab) for _ in range(vocab)])
    ref, dut = make_states(window, 4096, rng, vocab)
    t = ref.num_tokens
    # entries: slots 3, -1, 0, -1 (spares), inputs with a plain row between the plans
    slots = torch.tensor([3, -1, 0, -1])
    q0 = torch.tensor([0, 0, t + 1, 0])
    r0 = torch.tensor([0, 0, t + 1, 0])
    num_tokens = 2 * t + 1
    torch.manual_seed(0)
    caches = [KVCache(2, 16, 4, 2, 8, torch.float32, "cpu", layout=lay)
              for lay in ("NHD", layout)]
    caches[0].k.normal_(), caches[0].v.normal_()
    caches[1].k.copy_(caches[0].k), caches[1].v.copy_(caches[0].v)
    slot_mapping = torch.randperm(caches[0].k.shape[1] * 4)[:num_tokens].to(torch.int32)
    torch_step, kernel_step = DeviceSpecStep(ref), DeviceSpecStep(dut)
    kernel_step.proposer.use_kernels(True)  # the CUDA path, interpreted
    accepted = 0
    for step in range(6):
        outs = []
        for st, cache in ((torch_step, caches[0]), (kernel_step, caches[1])):
            entries = SpecEntries(slots.clone(), q0.clone(), r0.clone())
            ids = torch.full((num_tokens,), -5, dtype=torch.int32)
            proposal = st.prologue(entries, ids)
            logits = torch.nn.functional.one_hot(bigram[ids.long().clamp(min=0)],
                                                 vocab).float()
            out = st.epilogue(entries, proposal, logits, slot_mapping, cache)
            outs.append((ids, out))
        (ids_a, a), (ids_b, b) = outs
        assert torch.equal(ids_a, ids_b), step
        assert (ids_a[t] == -5) and (ids_a[: t] >= 0).all()  # the plain row is untouched
        assert torch.equal(a.count, b.count) and a.count[[1, 3]].tolist() == [0, 0], step
        live = a.count > 0
        assert torch.equal(a.committed[live], b.committed[live]), step
        assert_same_state(ref, dut, step)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
        accepted += int((a.count[live] - 1).sum())
    if window[2]:
        assert accepted > 0  # moves were compared, not only bonus tokens


@pytest.mark.parametrize("window", [(4, 4, 4), (7, 7, 7), (2, 2, 1), (3, 3, 0)])
def test_fold_kernel_equals_commit_tokens(window):
    """The tokens plain steps committed, folded in one launch (``lookahead_fold``) vs the
    torch ops (``commit_tokens``): runs of 0, 1, short and longer than N tokens per slot,
    slots whose recent tokens still hold -1, spare entries (slot -1), repeated folds."""
    from kiln.runtime.kernels.lookahead import lookahead_fold

    rng = random.Random(sum(window) * 7)
    vocab = 6
    ref, dut = make_states(window, 5, rng, vocab)
    for step in range(5):
        slots = torch.tensor([3, -1, 0, 1, 4] if step % 2 else [2, 0, 4])
        counts = [0 if s < 0 else rng.choice([0, 1, 3, window[1] + 2, 11]) for s in slots.tolist()]
        width = max(max(counts), 1)
        tokens = torch.tensor([[rng.randrange(vocab) for _ in range(width)] for _ in counts])
        count = torch.tensor(counts)
        live = slots >= 0
        ref.commit_tokens(slots[live], tokens[live], count[live])
        lookahead_fold(slots, tokens, count, dut.keys, dut.conts, dut.cursor, dut.recent,
                       dut.total, dut.history, dut.g)
        assert_same_state(ref, dut, step)


@pytest.mark.parametrize("window", [(4, 3, 4), (7, 7, 7), None], ids=["tree-434", "tree-777",
                                                                     "chain-9"])
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_plans_staged_ahead_shift_to_the_slots_of_their_rows_indices(window, kernel):
    """A plan staged ahead (as if the step in flight committed one token) moves on by what
    that step committed beyond one: positions by delta, and each row's cache slot to that
    of token index x + delta + t. A tree's rows share positions, so the slot must come
    from the row's index, not its position (it did, and on the GPU a launched-ahead
    lookahead step wrote its KV over other rows': greedy output differed from plain)."""
    from kiln.runtime.kernels.lookahead import shift_staged_rows
    from kiln.runtime.speculative.device_ngram import DeviceNgram
    from kiln.runtime.speculative.device_step import (DeviceSpecStep, SpecEntries, StagedRows,
                                                      shift_rows)
    from kiln.runtime.speculative.lookahead_math import step_layout

    if window is None:
        state = DeviceNgram(4, 8, 3, 1, 512, torch.device("cpu"))
        offsets = torch.arange(state.num_tokens)
    else:
        state = DeviceLookahead(4, window, torch.device("cpu"))
        offsets = step_layout(*window).position_offsets
    t, bs, max_blocks = state.num_tokens, 4, 64
    g = torch.Generator().manual_seed(t)
    tables = torch.stack([torch.randperm(500, generator=g)[:max_blocks] for _ in range(3)])
    starts, deltas = [37, 5, 90], [4, 1, 3]  # seq 1: delta 0 (count 1), nothing moves
    # three sequences, each a staged plan (x's index = its position = start)
    q0 = torch.tensor([0, t, 2 * t])
    positions = torch.cat([s + offsets for s in starts]).to(torch.int32)
    idx = torch.cat([s + torch.arange(t) for s in starts])
    seqs = torch.arange(3).repeat_interleave(t)
    slots = (tables[seqs, idx // bs] * bs + idx % bs).to(torch.int32)
    staged = StagedRows(positions.clone(), slots.clone(),
                        torch.tensor([s + t for s in starts], dtype=torch.int32),
                        tables.to(torch.int32), bs)
    entries = SpecEntries(torch.tensor([2, 0, 3]), q0, q0, shift=torch.ones(3, dtype=torch.long),
                          seq=torch.arange(3))
    step = DeviceSpecStep(state)
    step.last_count[:3] = torch.tensor(deltas) + 1
    step.last_count[1] = 1
    if kernel:
        shift_staged_rows(entries.shift, entries.slots, entries.seq, entries.q0,
                          step.last_count, staged.positions, staged.slots,
                          staged.context_lens, staged.block_tables, bs, t)
    else:
        shift_rows(entries, staged, step.last_count, t, kernels=False)
    moved = torch.tensor([deltas[0], 0, deltas[2]]).repeat_interleave(t)
    want_idx = idx + moved
    assert staged.positions.tolist() == (positions + moved).tolist()
    assert staged.slots.tolist() == (tables[seqs, want_idx // bs] * bs
                                     + want_idx % bs).tolist()
    assert staged.context_lens.tolist() == [starts[0] + t + deltas[0], starts[1] + t,
                                            starts[2] + t + deltas[2]]
