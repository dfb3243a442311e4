"""Batched device ngram drafting/verification against the host oracles (``find_draft``,
``walk_tree``)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from helpers import find_draft

from kiln.runtime.speculative.device_ngram import find_drafts
from kiln.runtime.speculative.draft import DraftTree
from kiln.runtime.speculative.verify import verify_chains, walk_tree


def host_greedy(chain: list[int], argmax: list[int]) -> list[int]:
    """NgramWorker.verify for a greedy request: ``walk_tree`` down the chain."""
    req = SimpleNamespace(matcher=None, params=SimpleNamespace(greedy=True))
    return walk_tree(req, None, argmax, DraftTree.chain(chain).children())[0]


def random_row(rng: random.Random, n: int, vocab: int) -> list[int]:
    mode = rng.choice(["random", "pattern", "distinct"])
    if mode == "distinct":  # nothing can match
        return list(range(100, 100 + n))
    if mode == "pattern":  # a repeated motif with occasional mutations
        motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        row = [motif[i % len(motif)] for i in range(n)]
        return [rng.randrange(vocab) if rng.random() < 0.1 else t for t in row]
    return [rng.randrange(vocab) for _ in range(n)]


def random_batch(rng: random.Random, dtype: torch.dtype
                 ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Rows of mixed lengths, padded with garbage that would create false matches if read."""
    vocab = rng.randint(3, 6)
    lens = [rng.choice([0, 1, 2, 3, rng.randint(1, 24)]) for _ in range(rng.randint(1, 6))]
    rows = [random_row(rng, n, vocab) for n in lens]
    width = max(lens) + rng.randint(0, 6)
    padded = []
    for row in rows:
        pad = width - len(row)
        if row and rng.random() < 0.7:  # repeat the row's own tail: looks like a match
            garbage = [row[-1 - (i % min(len(row), 4))] for i in range(pad)]
        else:
            garbage = [rng.randrange(vocab) for _ in range(pad)]
        padded.append(row + garbage)
    history = torch.tensor(padded, dtype=dtype).reshape(len(rows), width)
    return rows, history, torch.tensor(lens, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_find_drafts_matches_oracle(dtype):
    for seed in range(150):
        rng = random.Random(seed)
        rows, history, lengths = random_batch(rng, dtype)
        max_match = rng.randint(1, 4)
        min_match = rng.randint(1, max_match)
        max_len = rng.randint(1, 8)
        drafts, draft_lens = find_drafts(history, lengths, max_match, min_match, max_len)
        assert drafts.shape == (len(rows), max_len) and drafts.dtype == torch.long
        assert draft_lens.shape == (len(rows),) and draft_lens.dtype == torch.long
        for b, row in enumerate(rows):
            want = find_draft(row, max_match, min_match, max_len)
            n = int(draft_lens[b])
            ctx = (seed, row, max_match, min_match, max_len)
            assert n == len(want), ctx
            assert drafts[b, :n].tolist() == want, ctx
            assert not drafts[b, n:].any(), ctx


def test_find_drafts_known_cases():
    rows = [[1, 2, 3, 1, 2], [5, 6, 7, 8], [4, 4, 4], [9], []]
    width = 6
    history = torch.tensor([r + [r[-1] if r else 0] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    drafts, draft_lens = find_drafts(history, lengths, max_match=3, min_match=1, max_len=4)
    assert draft_lens.tolist() == [3, 0, 1, 0, 0]
    assert drafts.tolist() == [[3, 1, 2, 0], [0] * 4, [4, 0, 0, 0], [0] * 4, [0] * 4]


@pytest.mark.parametrize("seed", range(150))
def test_verify_chains_matches_host(seed):
    rng = random.Random(seed)
    bsz, depth, vocab = rng.randint(1, 6), rng.randint(0, 8), rng.randint(2, 5)
    drafts = [[rng.randrange(vocab) for _ in range(depth)] for _ in range(bsz)]
    draft_lens = [rng.randint(0, depth) for _ in range(bsz)]
    argmax = []
    for draft, dl in zip(drafts, draft_lens):
        agree = rng.randint(0, dl)
        row = draft[:agree] + [rng.randrange(vocab) for _ in range(depth + 1 - agree)]
        if agree < dl:
            row[agree] = (draft[agree] + 1) % vocab
        if rng.random() < 0.5:  # past draft_lens the drafts agree too: must be ignored
            row[dl:depth] = draft[dl:]
        argmax.append(row)
    accepted, counts = verify_chains(torch.tensor(drafts, dtype=torch.long).reshape(bsz, depth),
                                     torch.tensor(draft_lens), torch.tensor(argmax))
    assert accepted.shape == (bsz, depth + 1) and accepted.dtype == torch.long
    for b in range(bsz):
        want = host_greedy(drafts[b][:draft_lens[b]], argmax[b])
        c = int(counts[b])
        assert c == len(want) >= 1
        assert accepted[b, :c].tolist() == want
        assert not accepted[b, c:].any()


def test_verify_chains_empty_drafts():
    argmax = torch.tensor([[7, 1, 2], [3, 3, 3]])
    drafts = torch.tensor([[1, 2], [3, 3]])
    accepted, counts = verify_chains(drafts, torch.zeros(2, dtype=torch.long), argmax)
    assert counts.tolist() == [1, 1]
    assert accepted.tolist() == [[7, 0, 0], [3, 0, 0]]


def test_fixed_shapes_without_reading_values():
    """Meta tensors have no values: any host sync or data-dependent shape would raise."""
    history = torch.empty(4, 16, dtype=torch.int32, device="meta")
    lengths = torch.empty(4, dtype=torch.int32, device="meta")
    drafts, draft_lens = find_drafts(history, lengths, 3, 1, 5)
    assert drafts.shape == (4, 5) and draft_lens.shape == (4,)
    argmax = torch.empty(4, 6, dtype=torch.long, device="meta")
    accepted, counts = verify_chains(drafts, draft_lens, argmax)
    assert accepted.shape == (4, 6) and counts.shape == (4,)
