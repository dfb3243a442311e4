"""Suffix decoding's host structures and settings: the suffix tree (matches, counts, the
draft that adapts to the match), the shared response cache (bounded, oldest evicted first,
nothing left behind) and the build / request validation of mode "suffix"."""

from __future__ import annotations

import random

import pytest

from kiln.artifact.speculative import SpeculativeConfig
from kiln.errors import RequestError
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative.suffix import ResponseCache, SuffixIndex, SuffixTree
from kiln.runtime.speculative.workers import request_window, validate_request_draft_len


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


def test_a_draft_follows_the_longest_earlier_match_and_adapts_to_its_length():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    tree = SuffixTree(16)
    tree.extend(text, [])
    # "... 2 3 4" matched (3 tokens): at most 3 draft tokens (SPEC_FACTOR 1)
    s = tree.speculate([9, 9, 2, 3, 4], max_tokens=8, min_match=1)
    assert (s.tokens, s.match_len) == ([5, 6, 7], 3)
    # a 6-token match drafts 6, capped by max_tokens
    s = tree.speculate([1, 2, 3, 4, 5, 6], max_tokens=4, min_match=1)
    assert (s.tokens, s.match_len) == ([7, 8, 9, 10], 6)
    # match + draft stay within the depth: the 4-token match may draft 1, "2 3 4" drafts 2
    # and scores higher (a tie with "3 4" goes to the longer match)
    small = SuffixTree(5)
    small.extend(text, [])
    s = small.speculate([1, 2, 3, 4], max_tokens=8, min_match=1)
    assert (s.tokens, s.match_len) == ([5, 6], 3)
    # below the minimum match: nothing
    assert tree.speculate([9, 9, 4], max_tokens=8, min_match=2).tokens == []
    assert tree.speculate([99], max_tokens=8, min_match=1).tokens == []


def test_the_most_frequent_continuation_wins_and_rare_ones_are_cut():
    tree = SuffixTree(8)
    for tail in ([7, 7], [7, 7], [7, 7], [8, 8]):
        tree.extend([1, 2, 3] + tail, [])
    assert tree.speculate([1, 2, 3], 8, 1).tokens == [7, 7]  # 3 of 4 continuations
    tree2 = SuffixTree(8)
    for k in range(12):  # 12 different continuations: each 1/12 < MIN_TOKEN_PROB
        tree2.extend([1, 2, 3, 100 + k], [])
    assert tree2.speculate([1, 2, 3], 8, 1).tokens == []


def test_the_request_index_sees_its_own_earlier_text_and_the_cache():
    cache = ResponseCache(depth=12, max_requests=4)
    idx = SuffixIndex(12, 2, 8, cache)
    ids = [5, 6, 7, 8, 9, 5, 6]
    assert idx.draft(ids, len(ids)) == [7, 8]  # its own "5 6 -> 7 8 ..." (match 2)
    cache.add([40, 41, 42, 43, 44, 45, 46, 47])
    ids += [40, 41, 42, 43]
    assert idx.draft(ids, len(ids)) == [44, 45, 46, 47]  # the cached response, match 4


def test_the_cache_is_bounded_evicts_oldest_first_and_leaves_nothing_behind():
    cache = ResponseCache(depth=6, max_requests=3)
    rng = random.Random(1)
    responses = [[rng.randrange(50) for _ in range(20)] for _ in range(10)]
    for i, r in enumerate(responses):
        cache.add(r)
        kept = responses[max(0, i - 2): i + 1]
        assert len(cache) == len(kept)
        assert _tree_counts(cache.tree(None)) == _substring_counts(kept, 6)  # oldest first
        assert cache.num_nodes == len(_substring_counts(kept, 6))
    for r in responses[-3:]:
        assert cache.tree(None).speculate(r[:5], 8, 2).tokens  # the newest are found
    off = ResponseCache(depth=6, max_requests=0)
    off.add([1, 2, 3])
    assert len(off) == 0 and off.num_nodes == 0 and off.tree(None) is None


def test_a_tenant_drafts_from_its_own_responses_only():
    cache = ResponseCache(depth=12, max_requests=8)
    secret = [40, 41, 42, 43, 44, 45, 46, 47]
    cache.add(secret, "alice")
    ids = [1, 2, 40, 41, 42, 43]
    for scope in ("bob", None):  # another tenant, and the engine-wide cache
        idx = SuffixIndex(12, 2, 8, cache, scope)
        assert idx.draft(ids, len(ids)) == [], scope
    assert SuffixIndex(12, 2, 8, cache, "alice").draft(ids, len(ids)) == [44, 45, 46, 47]
    cache.add(secret)  # the same text in the engine-wide cache: found there, not by bob
    assert SuffixIndex(12, 2, 8, cache).draft(ids, len(ids)) == [44, 45, 46, 47]
    assert SuffixIndex(12, 2, 8, cache, "bob").draft(ids, len(ids)) == []


def test_the_bound_holds_over_every_tenant_and_an_emptied_tenant_leaves_nothing():
    cache = ResponseCache(depth=6, max_requests=3)
    rng = random.Random(2)
    added = []
    for i in range(12):
        r, scope = [rng.randrange(50) for _ in range(15)], ("a", "b", None, "c")[i % 4]
        cache.add(r, scope)
        added.append((scope, r))
        kept = added[-3:]  # the 3 newest responses, whichever tenant sent them
        assert len(cache) == len(kept)
        for name in ("a", "b", "c", None):
            mine = [r for s, r in kept if s == name]
            tree = cache.tree(name)
            assert (tree is None) == (not mine), (i, name)
            if mine:
                assert _tree_counts(tree) == _substring_counts(mine, 6)
        assert cache.num_nodes == sum(len(_substring_counts([r for s, r in kept if s == n], 6))
                                      for n in {s for s, _ in kept})


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
