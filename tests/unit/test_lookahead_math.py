"""Lookahead math: step layout/mask, n-gram pool, greedy and sampling verification."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from helpers import pool_tensors

from kiln.artifact.speculative import tokens_per_step
from kiln.runtime.speculative.lookahead import verify_candidates
from kiln.runtime.speculative.lookahead_math import NgramPool, build_step_layout, num_step_tokens
from kiln.runtime.speculative.verify import verify_position

# LOOKAHEAD.md worked example, W=3, N=3, G=2: (token, position offset, rows it sees)
WORKED = [
    ("x", 0, {0}),
    ("a1", 1, {0, 1}),
    ("a2", 2, {0, 1, 2}),
    ("b0", 1, {0, 3}),
    ("b1", 2, {0, 1, 4}),
    ("b2", 3, {0, 1, 2, 5}),
    ("u1", 1, {0, 6}),
    ("u2", 2, {0, 6, 7}),
    ("v1", 1, {0, 8}),
    ("v2", 2, {0, 8, 9}),
]


def lookahead_rows(lay) -> torch.Tensor:
    """All rows [T - g(N-1)] of x and the lookahead branch of a ``StepLayout``, in in-step
    order."""
    return torch.arange(lay.num_tokens - lay.candidate_rows.numel())


def test_worked_example_w3_n3_g2():
    lay = build_step_layout(3, 3, 2)
    assert lay.num_tokens == 10 == tokens_per_step(3, 3, 2)
    assert lay.position_offsets.tolist() == [pos for _, pos, _ in WORKED]
    expected = torch.zeros(10, 10, dtype=torch.bool)
    for r, (_, _, sees) in enumerate(WORKED):
        expected[r, sorted(sees)] = True
    assert torch.equal(lay.mask, expected)
    assert lay.window_rows.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert lay.last_level_rows.tolist() == [3, 4, 5]
    assert lay.candidate_rows.tolist() == [[6, 7], [8, 9]]
    assert lookahead_rows(lay).tolist() == [0, 1, 2, 3, 4, 5]


def test_plain_and_n2_layouts():
    plain = build_step_layout(1, 1, 0)
    assert plain.num_tokens == 1
    assert plain.mask.tolist() == [[True]]
    assert plain.position_offsets.tolist() == [0]
    # N=2: x + (W-1) level-0 tokens + G one-token candidates; level 0 is the last level
    lay = build_step_layout(3, 2, 2)
    assert lay.num_tokens == 5 == tokens_per_step(3, 2, 2)
    assert lay.position_offsets.tolist() == [0, 1, 2, 1, 1]
    assert lay.last_level_rows.tolist() == [0, 1, 2]
    assert lay.candidate_rows.tolist() == [[3], [4]]
    assert lay.mask[3].nonzero().flatten().tolist() == [0, 3]
    assert lay.mask[4].nonzero().flatten().tolist() == [0, 4]


@pytest.mark.parametrize("bad", [(0, 3, 1), (3, 0, 1), (3, 3, -1), (2, 1, 0), (1, 1, 1)])
def test_layout_rejects_invalid_windows(bad):
    with pytest.raises(ValueError, match=r"\(.*\) is invalid"):
        build_step_layout(*bad)


def _windows():
    out = [(1, 1, 0)]
    for w, n, g in itertools.product(range(1, 6), range(2, 7), range(0, 6)):
        out.append((w, n, g))
    return out


@pytest.mark.parametrize("w,n,g", _windows())
def test_layout_one_token_per_position_on_own_chain(w, n, g):
    lay = build_step_layout(w, n, g)
    t = lay.num_tokens
    assert t == num_step_tokens(w, n, g)
    assert t == tokens_per_step(w, n, g)
    if n > 1:
        assert t == (w + g) * (n - 1)
    pos = lay.position_offsets
    cand_rows = set(lay.candidate_rows.flatten().tolist())
    look_rows = set(range(t)) - cand_rows
    assert look_rows == set(lookahead_rows(lay).tolist())
    for r in range(t):
        seen = lay.mask[r].nonzero().flatten().tolist()
        assert r in seen and 0 in seen
        seen_pos = sorted(pos[seen].tolist())
        # exactly one token per position from p to the row's own position
        assert seen_pos == list(range(int(pos[r]) + 1)), (r, seen_pos)
        # candidates never see the lookahead branch (except x) nor other candidates;
        # the lookahead branch never sees candidates
        if r in cand_rows:
            i = (lay.candidate_rows == r).nonzero()[0, 0]
            own = set(lay.candidate_rows[i].tolist())
            assert set(seen) <= own | {0}
        else:
            assert not (set(seen) & cand_rows)
    # column j read down the levels is a chain of consecutive positions
    win = lay.window_rows
    for lvl in range(win.shape[0]):
        for j in range(w):
            assert int(pos[win[lvl, j]]) == lvl + j
    # the mask is "causal" in the sense that nothing sees a later position
    assert not (lay.mask & (pos[None, :] > pos[:, None])).any()


# ---------------------------------------------------------------- n-gram pool


def test_pool_dedup_evict_and_recency():
    pool = NgramPool(3, 2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([1, 2, 3])  # duplicate: nothing changes (no refresh: the bucket is a ring)
    assert pool.candidates(1) == [(4, 5), (2, 3)]
    assert len(pool) == 2
    pool.add([1, 6, 7])  # overwrites the oldest write, (2, 3)
    assert pool.candidates(1) == [(6, 7), (4, 5)]
    assert [1, 2, 3] not in pool and [1, 6, 7] in pool
    assert pool.candidates(1, 1) == [(6, 7)]
    assert pool.candidates(99) == []


def test_pool_keys_sharing_a_bucket_share_its_entries():
    pool = NgramPool(2, 2, buckets=4)
    pool.add([1, 10])
    pool.add([5, 50])  # 5 % 4 == 1: same bucket as key 1
    assert pool.candidates(1) == [(10,)] and pool.candidates(5) == [(50,)]
    pool.add([9, 90])  # bucket 1 again: overwrites the oldest, key 1's entry
    assert pool.candidates(1) == [] and pool.candidates(5) == [(50,)]
    assert pool.candidates(9) == [(90,)]
    with pytest.raises(ValueError, match="buckets"):
        NgramPool(2, 2, buckets=0)


def test_pool_seed_from_prompt():
    pool = NgramPool(3, 4)
    pool.seed_from_tokens([5, 6, 7, 5, 6, 8, 5, 6, 7])
    # n-grams: 567 675 756 568 685 856 567 (a duplicate: ignored)
    assert pool.candidates(5) == [(6, 8), (6, 7)]
    assert pool.candidates(6) == [(8, 5), (7, 5)]
    assert pool.candidates(7) == [(5, 6)]
    assert pool.candidates(8) == [(5, 6)]
    short = NgramPool(4, 2)
    short.seed_from_tokens([1, 2])
    assert len(short) == 0


def test_pool_rejects_bad_input():
    with pytest.raises(ValueError, match="n >= 2"):
        NgramPool(1, 2)
    pool = NgramPool(3, 2)
    with pytest.raises(ValueError, match="has 2 tokens, pool n is 3"):
        pool.add([1, 2])
    zero = NgramPool(2, 0)
    zero.add([1, 2])
    assert zero.candidates(1) == []


def test_pool_add_from_is_add_of_each_ngram_in_order():
    """``add_from`` (the per-token feed) inserts what ``add`` of each n-gram ending in
    [start, end) does, in order: the same table, cursors and recency, for ints, tensor
    elements and a bucket count that makes keys collide."""
    import random

    rng = random.Random(7)
    toks = [rng.randrange(9) for _ in range(300)]
    for buckets in (4096, 3):
        ref, fast = NgramPool(4, 3, buckets), NgramPool(4, 3, buckets)
        for e in range(3, len(toks)):
            ref.add(toks[e - 3 : e + 1])
        fast.add_from(toks, 0, 120)
        fast.add_from(torch.tensor(toks), 120, 121)  # tensor elements become ints
        fast.add_from(toks, 121, len(toks))
        assert pool_tensors(fast)[0].equal(pool_tensors(ref)[0])
        assert all(fast.candidates(k) == ref.candidates(k) for k in range(9))
        assert all(type(t) is int for c in fast.candidates(toks[120 - 3]) for t in c)


def test_plain_commits_reach_the_host_pool_before_the_next_proposal():
    """A paced request that decodes plainly defers its pool inserts: the pool a proposal
    reads, and the pool after a verified commit, equal feeding at every commit."""
    from kiln.runtime.request import Request
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.runtime.speculative.lookahead import LookaheadWorker

    prompt = [5, 6, 7, 5, 6, 8]
    req = Request("r", prompt, SamplingParams(max_tokens=100, temperature=0), frozenset())
    worker = LookaheadWorker()
    worker.init_request(req, (3, 3, 2))
    st = req.spec_state
    eager = NgramPool(3, 2)
    eager.seed_from_tokens(prompt)
    for tok in (5, 6, 9, 5, 6):  # plain steps: nothing inserted yet
        req.commit([tok], None, 1 << 30, 0.0)
        worker.on_commit(req, 1, False)
        eager.add(req.all_token_ids[-3:])
    assert st.pool.candidates(6) != eager.candidates(6)
    plan = worker.propose(req)  # the deferred n-grams go in first
    assert pool_tensors(st.pool)[0].equal(pool_tensors(eager)[0])
    assert plan.data[1] == eager.candidates(6)
    req.commit([9, 5], None, 1 << 30, 0.0)  # a verified step: fed at once
    worker.on_commit(req, 2, True)
    for end in (len(req.all_token_ids) - 1, len(req.all_token_ids)):
        eager.add(req.all_token_ids[end - 3 : end])
    assert st.pool.candidates(9) == eager.candidates(9)
    assert st.pool.candidates(6) == eager.candidates(6)


# ---------------------------------------------------------------- greedy verification


def greedy_verify(cands, argmax_rows, argmax_x):
    """``verify_candidates`` for a greedy request: candidate i's token k at row
    1 + i * len + k, ``argmax_rows[i][k]`` the model's token after it, ``argmax_x`` at x.
    Returns (the candidate whose rows the accepted drafts' KV comes from, committed)."""
    width = len(cands[0]) if cands else 0
    rows = [[1 + i * width + k for k in range(width)] for i in range(len(cands))]
    argmax = [argmax_x] + [t for am in argmax_rows for t in am]
    req = SimpleNamespace(matcher=None, params=SimpleNamespace(greedy=True))
    accepted, moves = verify_candidates(req, None, argmax, [tuple(c) for c in cands], rows)
    assert [k for _, k in moves] == list(range(1, len(accepted)))
    best = {(r - 1) // width for r, _ in moves} if moves else set()
    assert len(best) <= 1  # the accepted drafts' KV comes from one candidate's rows
    return (best.pop() if best else None), accepted


def test_greedy_verify_longest_match_plus_bonus():
    # N = 4: candidates of 3 tokens; t0 = argmax at x = 10
    cands = [[10, 11, 99], [10, 11, 12], [7, 8, 9]]
    argmax = [
        [11, 12, 13],  # after 10 -> 11 (match), after 11 -> 12 (99 mismatches)
        [11, 12, 13],  # full match: 10 11 12 + bonus 13
        [1, 2, 3],
    ]
    best, acc = greedy_verify(cands, argmax, 10)
    assert best == 1
    assert acc == [10, 11, 12, 13]
    assert len(acc) <= 4


def test_greedy_verify_partial_and_ties():
    cands = [[10, 5, 5], [10, 11, 5]]
    argmax = [[11, 0, 0], [11, 20, 0]]
    best, acc = greedy_verify(cands, argmax, 10)
    assert (best, acc) == (1, [10, 11, 20])
    # tie: first candidate wins
    best, acc = greedy_verify([[10, 1], [10, 2]], [[3, 0], [4, 0]], 10)
    assert (best, acc) == (0, [10, 3])


def test_greedy_verify_no_match_and_empty():
    assert greedy_verify([[1, 2], [3, 4]], [[0, 0], [0, 0]], 9) == (None, [9])
    assert greedy_verify([], [], 9) == (None, [9])


# ---------------------------------------------------------------- sampling verification


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


@pytest.mark.parametrize("drafts", [[], [2, 5], [5, 5, 1], [3, 0, 1, 2, 4, 5]])
def test_verify_position_preserves_distribution(drafts):
    p = torch.tensor([0.30, 0.05, 0.20, 0.15, 0.0, 0.30])
    g = torch.Generator().manual_seed(1234)
    trials = 20_000
    counts = torch.zeros(6, dtype=torch.float64)
    accepted = 0
    for _ in range(trials):
        tok, idx = verify_position(p, drafts, g)
        counts[tok] += 1
        if idx is not None:
            assert drafts[idx] == tok
            accepted += 1
    assert counts[4] == 0  # zero-probability token never produced
    assert _tv(counts, p) < 0.03
    if drafts:
        assert accepted > 0


def _verify_position_walk(p, drafts, generator):
    """The rule as it was first written (a Python walk over the vocabulary): the oracle
    the tensor form must match draw for draw."""
    u = torch.rand(len(drafts) + 1, generator=generator, dtype=torch.float64).tolist()
    q = p.to(torch.float64).tolist()
    for idx, d in enumerate(drafts):
        total = sum(q)
        if total <= 0.0:
            break
        if u[idx] * total < q[d]:
            return int(d), idx
        q[d] = 0.0
    total = sum(q)
    if total <= 0.0:
        q = p.to(torch.float64).tolist()
        total = sum(q)
    target, acc, last = u[-1] * total, 0.0, 0
    for tok, mass in enumerate(q):
        if mass <= 0.0:
            continue
        acc += mass
        last = tok
        if target < acc:
            return tok, None
    return last, None


@pytest.mark.parametrize("drafts", [[], [2, 5], [5, 5, 1], [3, 0, 1, 2, 4, 5], [4, 4]])
def test_verify_position_draws_what_the_vocabulary_walk_draws(drafts):
    """Same generator, same draws, same (token, accepted draft) as the walk, over 3000
    seeds (duplicates, a zero-mass draft, every token a draft)."""
    p = torch.tensor([0.30, 0.05, 0.20, 0.15, 0.0, 0.30])
    for seed in range(3000):
        got = verify_position(p, drafts, torch.Generator().manual_seed(seed))
        assert got == _verify_position_walk(p, drafts, torch.Generator().manual_seed(seed)), seed


def test_verify_position_accepts_certain_draft():
    p = torch.tensor([0.0, 1.0, 0.0])
    assert verify_position(p, [1], torch.Generator().manual_seed(0)) == (1, 0)
    assert verify_position(p, [0, 2], torch.Generator().manual_seed(0)) == (1, None)
    with pytest.raises(ValueError, match="shape \\[V\\]"):
        verify_position(p[None], [0])


def test_step_layout_is_built_once_per_window_and_shared():
    """step_layout caches per (w, n, g) for the process: two requests (and two calls) get
    the same object, equal to a fresh build; warm_layouts builds every g of a window."""
    from kiln.runtime.speculative.lookahead import warm_layouts
    from kiln.runtime.speculative.lookahead_math import step_layout

    step_layout.cache_clear()
    warm_layouts((4, 3, 2))
    assert step_layout.cache_info().currsize == 3  # g = 0, 1, 2
    a, b = step_layout(4, 3, 2), step_layout(4, 3, 2)
    assert a is b and step_layout.cache_info().hits >= 2
    fresh = build_step_layout(4, 3, 2)
    assert torch.equal(a.mask, fresh.mask) and torch.equal(a.position_offsets,
                                                           fresh.position_offsets)
    assert a.row_lists == fresh.row_lists


# ---------------------------------------------------------------- prompt-lookup candidate

def test_with_lookup_takes_the_slot_after_the_pool_candidates():
    from kiln.runtime.speculative.lookahead_math import with_lookup

    pool = [(1, 2, 3), (4, 5, 6)]
    assert with_lookup(pool, [], 3, 4) == pool  # no match: nothing changes
    assert with_lookup(pool, [7, 8, 9], 3, 0) == pool  # G = 0: no candidate slot
    assert with_lookup(pool, [4, 5, 6, 7], 3, 4) == pool  # already a candidate (cut to N-1)
    assert with_lookup(pool, [7, 8, 9], 3, 4) == pool + [(7, 8, 9)]  # after the pool's
    assert with_lookup(pool, [7], 3, 4) == pool + [(7, 0, 0)]  # padded with 0
    assert with_lookup(pool, [7, 8, 9], 3, 2) == [(1, 2, 3), (7, 8, 9)]  # G full: the last
    assert with_lookup([], [7, 8], 2, 1) == [(7, 8)]


def test_the_worker_proposes_the_latest_match_of_its_last_tokens():
    """G = 2: the pool keeps x = 5's two latest continuations, (6, 7) and (9, 9); the text's
    last three tokens (3, 4, 5) occurred first, followed by 8, 1 (evicted from the pool):
    that continuation takes the last candidate slot."""
    from kiln.runtime.request import Request
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.runtime.speculative.lookahead import LookaheadWorker

    prompt = [3, 4, 5, 8, 1, 2, 5, 6, 7, 0, 5, 9, 9, 3, 4, 5]
    req = Request("r", prompt, SamplingParams(max_tokens=100, temperature=0), frozenset())
    worker = LookaheadWorker(match=(3, 2))
    worker.init_request(req, (2, 3, 2))
    assert req.spec_state.pool.candidates(5) == [(9, 9), (6, 7)]
    plan = worker.propose(req)
    assert plan.data[1] == [(9, 9), (8, 1)]
    assert plan.token_ids[-4:] == [9, 9, 8, 1]
