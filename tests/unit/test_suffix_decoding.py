"""Suffix decoding's host structures and settings: the token index against the rule's
oracle, a depth-bounded suffix trie (matches, counts, the draft that adapts to the match),
the shared response cache (bounded, oldest evicted first, nothing left behind, kept apart
per tenant) and the build / request validation of mode "suffix"."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Sequence

import pytest

from kiln.artifact.speculative import SpeculativeConfig
from kiln.errors import RequestError
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative.suffix import (
    MIN_TOKEN_PROB,
    SPEC_FACTOR,
    ResponseCache,
    Speculation,
    SuffixIndex,
    TokenIndex,
)
from kiln.runtime.speculative.workers import request_window, validate_request_draft_len


# -- the oracle: the rule as a suffix trie of bounded depth, every count kept --------------
class _Node:
    __slots__ = ("count", "total", "children")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the node's string (as a substring, its end counted)
        self.total = 0  # the children's counts summed: occurrences with a continuation
        self.children: dict[int, _Node] = {}


def _push(heap, order, node, parent, depth, prob):
    """A trie node's children onto the best-first heap (in the order they were first seen),
    each at its probability when that is >= MIN_TOKEN_PROB."""
    for tok, child in node.children.items():
        p = prob * child.count / node.total
        if p >= MIN_TOKEN_PROB:
            heapq.heappush(heap, (-p, next(order), parent, depth, tok, child))


class SuffixTree:
    """A suffix trie of depth ``depth`` with occurrence counts, over any number of token
    sequences. ``extend(tokens, active)`` appends tokens to one sequence whose open
    suffixes are ``active`` (the nodes of its last 1..depth-1 tokens, shortest first;
    [] for a new sequence) and returns its new ``active``; ``remove(tokens)`` takes a whole
    sequence out again (the same walk, counting down, pruning nodes that reach 0)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0

    def extend(self, tokens: Sequence[int], active: list[_Node]) -> list[_Node]:
        keep = self.depth - 1
        for t in tokens:
            nxt = []
            for node in [self.root, *active[:keep]]:  # suffixes of length 0..depth-1 grow
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    self.num_nodes += 1
                child.count += 1
                node.total += 1
                nxt.append(child)
            active = nxt
        return active[:keep]

    def remove(self, tokens: Sequence[int]) -> None:
        keep = self.depth - 1
        active: list[_Node] = []
        for t in tokens:
            nxt = []
            for node in [self.root, *active[:keep]]:
                child = node.children[t]
                child.count -= 1
                node.total -= 1
                if child.count == 0:  # no occurrence left: neither of its descendants'
                    del node.children[t]
                    self.num_nodes -= 1
                nxt.append(child)
            active = nxt

    def find(self, pattern: Sequence[int]) -> _Node | None:
        node = self.root
        for t in pattern:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], max_tokens: int, min_match: int
                  ) -> Speculation:
        """The best draft tree after ``context``'s last tokens (see the module docstring):
        grown best first from the match's node, children in the order they were first
        seen."""
        best = Speculation()
        for m in range(min(len(context), self.depth - 1), min_match - 1, -1):
            if best.score >= min(max_tokens, math.ceil(m * SPEC_FACTOR)):
                break  # no shorter match can draft enough to score higher
            node = self.find(context[len(context) - m:])
            if node is None or not node.children:
                continue
            s = Speculation(match_len=m)
            heap, order = [], itertools.count()
            _push(heap, order, node, -1, 1, 1.0)
            while heap and len(s.tokens) < min(max_tokens, math.ceil(m * SPEC_FACTOR)):
                neg, _, parent, depth, tok, child = heapq.heappop(heap)
                s.tokens.append(tok)
                s.parents.append(parent)
                s.score -= neg
                if depth < self.depth - m:
                    _push(heap, order, child, len(s.tokens) - 1, depth + 1, -neg)
            if s.score > best.score:
                best = s
        return best



def _substring_counts(seqs, depth):
    counts = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                counts[tuple(s[i:j])] = counts.get(tuple(s[i:j]), 0) + 1
    return counts


def _tree_counts(tree):
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        assert node.total == sum(c.count for c in node.children.values()), path
        for t, child in node.children.items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


def test_the_tree_counts_every_substring_up_to_its_depth_grown_in_pieces():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    tree = SuffixTree(5)
    for s in seqs:
        active = []
        for a, b in ((0, 3), (3, 4), (4, len(s))):  # appended in pieces, as tokens commit
            active = tree.extend(s[a:b], active)
    want = _substring_counts(seqs, 5)
    assert _tree_counts(tree) == want
    assert tree.num_nodes == len(want)


def _index(seqs, depth, min_match=1):
    index = TokenIndex(depth, min_match)
    for seq in seqs:
        index.extend(seq)
        index.close()
    return index


def _trie(seqs, depth):
    tree = SuffixTree(depth)
    for seq in seqs:
        tree.extend(seq, [])
    return tree


def test_a_draft_follows_the_longest_earlier_match_and_adapts_to_its_length():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    index = _index([text], 16)
    # "... 2 3 4" matched (3 tokens): at most 3 draft tokens (SPEC_FACTOR 1)
    s = index.speculate([9, 9, 2, 3, 4], max_tokens=8, min_match=1)
    assert (s.tokens, s.match_len) == ([5, 6, 7], 3)
    # a 6-token match drafts 6, capped by max_tokens
    s = index.speculate([1, 2, 3, 4, 5, 6], max_tokens=4, min_match=1)
    assert (s.tokens, s.match_len) == ([7, 8, 9, 10], 6)
    # match + draft stay within the depth: the 4-token match may draft 1, "2 3 4" drafts 2
    # and scores higher (a tie with "3 4" goes to the longer match)
    s = _index([text], 5).speculate([1, 2, 3, 4], max_tokens=8, min_match=1)
    assert (s.tokens, s.match_len) == ([5, 6], 3)
    # below the minimum match: nothing; a match never crosses from one sequence to the next
    assert index.speculate([9, 9, 4], max_tokens=8, min_match=2).tokens == []
    assert index.speculate([99], max_tokens=8, min_match=1).tokens == []
    two = _index([[1, 2, 3], [4, 5, 6]], 16)
    assert two.speculate([2, 3, 4], max_tokens=8, min_match=2).tokens == []
    assert two.speculate([3], max_tokens=8, min_match=1).tokens == []  # 3 ends a sequence


def test_the_tree_holds_the_likeliest_continuations_and_rare_ones_are_cut():
    seqs = [[1, 2, 3] + tail for tail in ([7, 7], [7, 7], [7, 7], [8, 8])]
    # 3 nodes (the match is 3 long): 7 (3/4), its 7 (3/4), then 8 (1/4) beside the first 7
    s = _index(seqs, 8).speculate([1, 2, 3], 8, 1)
    assert (s.tokens, s.parents) == ([7, 7, 8], [-1, 0, -1])
    assert math.isclose(s.score, 0.75 + 0.75 + 0.25)
    assert s.tree.paths() == [[7, 7], [8]]
    # a longer match grows the tree on: 8's own 8 (1/4) joins after the 7s
    assert _index(seqs, 8).speculate([0, 1, 2, 3], 8, 1).match_len == 3  # no "0 1 2 3"
    seqs = [[0] + seq for seq in seqs]
    s = _index(seqs, 8).speculate([0, 1, 2, 3], 8, 1)
    assert (s.tokens, s.parents, s.match_len) == ([7, 7, 8, 8], [-1, 0, -1, 2], 4)
    # one child each: a chain, the most frequent continuation
    chain = _index([[1, 2, 3, 7, 7, 9]] * 2, 8).speculate([1, 2, 3], 8, 1)
    assert (chain.tokens, chain.parents) == ([7, 7, 9], [-1, 0, 1]) and chain.tree.is_chain
    rare = [[1, 2, 3, 100 + k] for k in range(12)]  # each 1/12 < MIN_TOKEN_PROB
    assert _index(rare, 8).speculate([1, 2, 3], 8, 1).tokens == []


@pytest.mark.parametrize("depth,min_match", [(24, 2), (6, 1), (16, 3), (4, 2)])
def test_the_index_drafts_what_the_suffix_trie_drafts(depth, min_match):
    """The oracle: a depth-bounded suffix trie with every count. Random text over a small
    vocabulary (many repeats, ties and long matches), every context of it and of fresh
    text, several draft budgets."""
    rng = random.Random(depth * 10 + min_match)
    for trial in range(6):
        vocab = rng.choice([3, 5, 12])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
                for _ in range(rng.randrange(1, 6))]
        index, trie = _index(seqs, depth, min_match), _trie(seqs, depth)
        contexts = [seq[:i] for seq in seqs for i in range(1, len(seq) + 1)]
        contexts += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
                     for _ in range(40)]
        for ctx in contexts:
            ctx = ctx[max(0, len(ctx) - depth + 1):]
            for budget in (1, 4, 16):
                got = index.speculate(ctx, budget, min_match)
                want = trie.speculate(ctx, budget, min_match)
                assert (got.tokens, got.parents, got.match_len) == (
                    want.tokens, want.parents, want.match_len), (trial, ctx, budget)
                assert math.isclose(got.score, want.score)


def test_the_request_index_sees_its_own_earlier_text_and_the_cache():
    cache = ResponseCache(depth=12, max_requests=4)
    idx = SuffixIndex(12, 2, 8, cache)
    ids = [5, 6, 7, 8, 9, 5, 6]
    assert idx.draft(ids, len(ids)).tokens == [7, 8]  # its own "5 6 -> 7 8 ..." (match 2)
    cache.add([40, 41, 42, 43, 44, 45, 46, 47])
    ids += [40, 41, 42, 43]
    assert idx.draft(ids, len(ids)).tokens == [44, 45, 46, 47]  # the cached response


def _drafts(index_or_tree, contexts, min_match):
    return [index_or_tree.speculate(c, 8, min_match).tokens for c in contexts]


def live_tokens(index: TokenIndex) -> int:
    """How many positions of a ``TokenIndex`` belong to sequences not evicted (end marks
    included)."""
    return index.end - index.live


def test_the_cache_is_bounded_evicts_oldest_first_and_leaves_nothing_behind():
    cache = ResponseCache(depth=6, max_requests=3)
    rng = random.Random(1)
    responses = [[rng.randrange(8) for _ in range(20)] for _ in range(12)]
    probes = [[rng.randrange(8) for _ in range(5)] for _ in range(60)]
    for i, r in enumerate(responses):
        cache.add(r)
        kept = responses[max(0, i - 2): i + 1]
        assert len(cache) == len(kept) and cache.num_tokens == sum(map(len, kept))
        # drafts as from the kept responses alone: the oldest went first
        assert _drafts(cache.index(None), probes, 2) == _drafts(_trie(kept, 6), probes, 2), i
    index = cache.index(None)  # compacted: about the kept text, not all that was added
    assert live_tokens(index) == sum(len(r) + 1 for r in responses[-3:])
    assert len(index.tokens) < 2 * live_tokens(index) + 21
    live = {p for table in index.at.values() for occ in table.values() for p in occ
            if p >= index.base}
    assert len(live) <= sum(len(t) for t in index.at.values()) * 2
    off = ResponseCache(depth=6, max_requests=0)
    off.add([1, 2, 3])
    assert len(off) == 0 and off.index(None) is None


def test_a_tenant_drafts_from_its_own_responses_only():
    cache = ResponseCache(depth=12, max_requests=8)
    secret = [40, 41, 42, 43, 44, 45, 46, 47]
    cache.add(secret, "alice")
    ids = [1, 2, 40, 41, 42, 43]
    for scope in ("bob", None):  # another tenant, and the engine-wide cache
        idx = SuffixIndex(12, 2, 8, cache, scope)
        assert idx.draft(ids, len(ids)).tokens == [], scope
    assert SuffixIndex(12, 2, 8, cache, "alice").draft(ids, len(ids)).tokens == [44, 45, 46, 47]
    cache.add(secret)  # the same text in the engine-wide cache: found there, not by bob
    assert SuffixIndex(12, 2, 8, cache).draft(ids, len(ids)).tokens == [44, 45, 46, 47]
    assert SuffixIndex(12, 2, 8, cache, "bob").draft(ids, len(ids)).tokens == []


def test_the_bound_holds_over_every_tenant_and_an_emptied_tenant_leaves_nothing():
    cache = ResponseCache(depth=6, max_requests=3)
    rng = random.Random(2)
    probes = [[rng.randrange(6) for _ in range(5)] for _ in range(40)]
    added = []
    for i in range(12):
        r, scope = [rng.randrange(6) for _ in range(15)], ("a", "b", None, "c")[i % 4]
        cache.add(r, scope)
        added.append((scope, r))
        kept = added[-3:]  # the 3 newest responses, whichever tenant sent them
        assert len(cache) == len(kept)
        for name in ("a", "b", "c", None):
            mine = [r for s, r in kept if s == name]
            index = cache.index(name)
            assert (index is None) == (not mine), (i, name)
            if mine:
                assert _drafts(index, probes, 2) == _drafts(_trie(mine, 6), probes, 2)


def test_build_validation_names_the_value_the_rule_and_the_fix():
    c = SpeculativeConfig.from_cli("suffix")
    assert (c.mode, c.max_draft_len, c.suffix_tree_depth, c.suffix_min_match,
            c.suffix_cache_requests) == ("suffix", 16, 24, 2, 256)
    d = c.to_dict()
    assert {k: d[k] for k in ("suffix_tree_depth", "suffix_min_match",
                              "suffix_cache_requests")} == {
        "suffix_tree_depth": 24, "suffix_min_match": 2, "suffix_cache_requests": 256}
    assert SpeculativeConfig.from_dict(d) == c
    assert "suffix_tree_depth" not in SpeculativeConfig.from_cli("ngram", None, 4).to_dict()
    c = SpeculativeConfig.from_cli("suffix-decoding", max_draft_len=6,
                                   suffix={"suffix_tree_depth": 8, "suffix_min_match": 2,
                                           "suffix_cache_requests": 0})
    assert (c.max_draft_len, c.suffix_tree_depth, c.suffix_cache_requests) == (6, 8, 0)
    with pytest.raises(ValueError, match=r"--max-draft-len 7 .*1 <= max_draft_len <= 6.*"
                                         r"--max-draft-len 6"):
        SpeculativeConfig.from_cli("suffix", max_draft_len=7,
                                   suffix={"suffix_tree_depth": 8})
    with pytest.raises(ValueError, match=r"--suffix-tree-depth 65 is invalid.*2 to 64"):
        SpeculativeConfig.from_cli("suffix", suffix={"suffix_tree_depth": 65})
    with pytest.raises(ValueError, match=r"--suffix-min-match 0 is invalid"):
        SpeculativeConfig.from_cli("suffix", suffix={"suffix_min_match": 0})
    with pytest.raises(ValueError, match=r"--suffix-cache-requests -1 is invalid"):
        SpeculativeConfig.from_cli("suffix", suffix={"suffix_cache_requests": -1})
    with pytest.raises(ValueError, match=r"--suffix-min-match 3 given but speculative "
                                         r"decoding mode is 'ngram'"):
        SpeculativeConfig.from_cli("ngram", None, 4, suffix={"suffix_min_match": 3})
    with pytest.raises(ValueError, match=r"--ngram-match 3 does not apply to mode 'suffix'"):
        SpeculativeConfig.from_cli("suffix", None, None, 3)
    with pytest.raises(ValueError, match=r"records no suffix_min_match"):
        SpeculativeConfig(mode="suffix", max_draft_len=4, suffix_tree_depth=8,
                          suffix_cache_requests=1)
    with pytest.raises(ValueError, match=r"suffix_tree_depth 8 is set but .* 'ngram'"):
        SpeculativeConfig(mode="ngram", max_draft_len=4, suffix_tree_depth=8)


def test_a_request_may_ask_for_fewer_draft_tokens_never_more():
    spec = SpeculativeConfig.from_cli("suffix", max_draft_len=8)
    assert validate_request_draft_len(spec, 3) == 3
    assert request_window(spec, SamplingParams(max_draft_len=8)) == (1, 1, 0)
    assert request_window(spec, SamplingParams(max_draft_len=0)) is None  # plain
    assert request_window(spec, SamplingParams(lookahead=(1, 1, 0))) is None
    with pytest.raises(RequestError, match=r"max_draft_len 9 exceeds the engine's 8") as e:
        request_window(spec, SamplingParams(max_draft_len=9))
    assert e.value.param == "max_draft_len"
    with pytest.raises(RequestError, match=r"lookahead \(2,2,1\) is not available"):
        request_window(spec, SamplingParams(lookahead=(2, 2, 1)))
