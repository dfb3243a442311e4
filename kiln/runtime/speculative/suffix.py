"""Suffix decoding: drafts from the request's own text and from a bounded cache of earlier
responses (Oliaro et al., SuffixDecoding; Snowflake's Arctic Inference), model-free.

The rule is a depth-D suffix trie's: a proposal matches the longest suffixes of the
request's last tokens (at least ``min_match``, at most D - 1) and grows, from each match, a
token tree best first: a node's probability is its parent's times the node's count over
its siblings' (the continuations of the tokens so far), x's children start at their
share, and the most probable node not yet in the tree joins it while it is >= ``MIN_TOKEN_PROB``,
for at most ``SPEC_FACTOR`` x the match length nodes (a longer match drafts more), each
at depth <= D - match. The tree with the highest score (the sum of its nodes'
probabilities: the tokens it is expected to get accepted) wins, over the request's text and
the cache's. A tree whose nodes each have one child is a chain, the most frequent
continuation; where the text continued in two ways often enough, the tree holds both.
It is verified in one step by ``walk_tree`` (greedy: the longest accepted path +
bonus token; sampled: recursive rejection over each node's children).

The text is not kept as a trie (D Python nodes a token: ~5.8 KB a cached token, 12 ms to
add a 200-token response; docs/decisions.md) but as ``TokenIndex``: the tokens in one array
and, for two key lengths (``min_match`` and ``LONG_KEY``), where each key occurs. A
proposal takes the newest ``MAX_CANDIDATES`` occurrences of the context's last keys,
measures each one's match backwards and counts continuations forwards over the
occurrences that match m tokens: the trie's counts, over those occurrences.

The cache takes a response when its request finishes (aborted and failed requests are not
kept) and evicts the oldest responses beyond ``suffix_cache_requests``. A request that
names a tenant (``SamplingParams.tenant``) drafts from and feeds that tenant's index only:
acceptance timing would otherwise tell one tenant whether another's continuation was seen
before.
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.request import Request
from kiln.runtime.speculative.draft import DraftTree
from kiln.runtime.speculative.worker import TreeWorker, walk_tree

# Arctic Inference's defaults: a draft no longer than its match, of tokens whose cumulative
# probability is at least 0.1
SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1
LONG_KEY = 8  # the second key length: long matches among few occurrences
MAX_CANDIDATES = 256  # occurrences of a key examined per proposal, newest first
_END = -1  # after each sequence of an index: no match or continuation crosses it


@dataclass
class Speculation:
    """A draft tree (``DraftTree``'s tokens and parents), its score (expected accepted
    tokens) and the match it followed."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0

    @property
    def tree(self) -> DraftTree:
        return DraftTree(self.tokens, self.parents)


class TokenIndex:
    """Token sequences, each followed by an end mark, and where every key (the ``k`` tokens
    before a position, for each key length k) occurs: ``at[k][key]`` lists the positions
    after its occurrences, oldest first. Positions are absolute; ``drop_oldest`` evicts the
    oldest sequence lazily (its positions stay in the lists, below ``live``, until a
    compaction once half the array is dead)."""

    def __init__(self, depth: int, min_match: int) -> None:
        self.depth = depth
        self.lengths = sorted({min_match, max(min_match, min(LONG_KEY, depth - 1))},
                              reverse=True)
        self.tokens = array("q")
        self.base = 0  # the absolute position of tokens[0]
        self.live = 0  # positions before it belong to evicted sequences
        self.at: dict[int, dict[int, array]] = {k: {} for k in self.lengths}
        self._open = 0  # where the sequence being appended started (absolute)

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the open sequence."""
        toks, base = self.tokens, self.base
        for t in tokens:
            toks.append(t)
            pos = base + len(toks)  # the position after t
            for k in self.lengths:
                if pos - k >= self._open:
                    key = hash(tuple(toks[pos - k - base:pos - base]))
                    occ = self.at[k].get(key)
                    if occ is None:
                        self.at[k][key] = array("q", (pos,))
                    else:
                        occ.append(pos)

    def close(self) -> int:
        """End the open sequence; returns where the next one starts."""
        self.tokens.append(_END)
        self._open = self.end
        return self._open

    def drop_oldest(self, upto: int) -> None:
        """Evict every sequence before absolute position ``upto``."""
        self.live = upto
        if self.live - self.base > len(self.tokens) // 2:
            self._compact()

    def _compact(self) -> None:
        cut = self.live - self.base
        self.tokens = self.tokens[cut:]
        self.base = self.live
        for k, table in self.at.items():
            for key in list(table):
                occ = table[key]
                if occ[-1] < self.live + k:
                    del table[key]
                elif occ[0] < self.live + k:
                    table[key] = array("q", (p for p in occ if p >= self.live + k))

    def _add_candidates(self, cands: dict[int, int], context: Sequence[int], k: int,
                        limit: int) -> None:
        """The newest occurrences of ``context``'s last ``k`` tokens that have a
        continuation, each with its match length (at most ``limit``) into ``cands``."""
        occ = self.at[k].get(hash(tuple(context[len(context) - k:])))
        if occ is None:
            return
        toks, base, last = self.tokens, self.base, len(context) - 1
        for pos in occ[-MAX_CANDIDATES:]:
            i = pos - base
            if pos - k < self.live or pos in cands or i >= len(toks) or toks[i] == _END:
                continue
            m = 0
            i -= 1
            while m < limit and i >= 0 and toks[i] == context[last - m]:
                m += 1
                i -= 1
            if m >= k:  # (a hash collision matches less)
                cands[pos] = m

    def speculate(self, context: Sequence[int], max_tokens: int, min_match: int
                  ) -> Speculation:
        """The best draft after ``context``'s last tokens (the module docstring's rule)."""
        limit = min(len(context), self.depth - 1)
        keys = [k for k in self.lengths if k <= limit]  # longest first
        base = self.base
        cands: dict[int, int] = {}  # position -> match length
        looked: set[int] = set()
        best = Speculation()
        m = limit
        while m >= min_match:
            if best.score >= min(max_tokens, math.ceil(m * SPEC_FACTOR)):
                break  # no shorter match can draft enough to score higher
            k = next(k for k in keys if k <= m)  # finds every occurrence matching >= m
            if k not in looked:
                self._add_candidates(cands, context, k, limit)
                looked.add(k)
            top = max(cands.values(), default=0)
            if top < m:  # none matches m: on to the longest that any does
                m = top if top >= k else k - 1
                continue
            cur = sorted(p - base for p, length in cands.items() if length >= m)
            s = self._grow(cur, min(max_tokens, math.ceil(m * SPEC_FACTOR)), self.depth - m)
            s.match_len = m
            if s.score > best.score:
                best = s
            m -= 1
        return best

    def _grow(self, starts: list[int], budget: int, max_depth: int) -> Speculation:
        """The tree after the occurrences whose continuations start at ``starts`` (array
        indices, oldest first): best first, at most ``budget`` nodes, ``max_depth`` deep.
        Ties go to the node found first: the oldest occurrence's continuation."""
        toks = self.tokens
        s = Speculation()
        heap: list = []  # (-probability, order found, parent, depth, token, its occurrences)
        order = itertools.count()

        def expand(occ: list[int], parent: int, depth: int, prob: float) -> None:
            groups: dict[int, list[int]] = {}
            for i in occ:
                t = toks[i] if i < len(toks) else _END
                if t != _END:
                    groups.setdefault(t, []).append(i + 1)
            total = sum(len(g) for g in groups.values())
            for t, nxt in groups.items():
                p = prob * len(nxt) / total
                if p >= MIN_TOKEN_PROB:
                    heapq.heappush(heap, (-p, next(order), parent, depth, t, nxt))

        expand(starts, -1, 1, 1.0)
        while heap and len(s.tokens) < budget:
            neg, _, parent, depth, tok, occ = heapq.heappop(heap)
            s.tokens.append(tok)
            s.parents.append(parent)
            s.score -= neg
            if depth < max_depth:
                expand(occ, len(s.tokens) - 1, depth + 1, -neg)
        return s


class ResponseCache:
    """The shared cache of earlier responses: a ``TokenIndex`` per scope (None: the
    engine-wide one; a tenant's name: that tenant's), over at most ``max_requests``
    responses in all, the oldest evicted first whichever scope holds it. A scope's index is
    dropped with its last response."""

    def __init__(self, depth: int, max_requests: int, min_match: int = 2) -> None:
        self.depth, self.max_requests, self.min_match = depth, max_requests, min_match
        self._indexes: dict[str | None, TokenIndex] = {}
        # oldest first: (scope, tokens, the position after its end mark)
        self._responses: OrderedDict[int, tuple[str | None, int, int]] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._responses)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self._responses.values())

    def index(self, scope: str | None) -> TokenIndex | None:
        """The index of ``scope``'s responses, or None while it holds none."""
        return self._indexes.get(scope)

    def add(self, tokens: Sequence[int], scope: str | None = None) -> None:
        if self.max_requests == 0 or not tokens:
            return
        index = self._indexes.get(scope)
        if index is None:
            index = self._indexes[scope] = TokenIndex(self.depth, self.min_match)
        index.extend(tokens)
        self._responses[self._next] = (scope, len(tokens), index.close())
        self._next += 1
        while len(self._responses) > self.max_requests:
            _, (old_scope, _, end) = self._responses.popitem(last=False)
            old = self._indexes[old_scope]
            if end == old.end:  # its last response
                del self._indexes[old_scope]
            else:
                old.drop_oldest(end)


class SuffixIndex:
    """One request's ``TokenIndex`` over its text (prompt + output), grown as tokens
    commit, and the proposal from it and the shared cache."""

    def __init__(self, depth: int, min_match: int, max_len: int, cache: ResponseCache,
                 scope: str | None = None) -> None:
        self.own = TokenIndex(depth, min_match)
        self.depth, self.min_match, self.max_len = depth, min_match, max_len
        self.cache, self.scope = cache, scope  # drafts from the cache of ``scope`` only
        self._n = 0  # tokens[:_n] are in the index
        self.from_cache = False  # the last draft came from the cache
        self.matched = 0  # how many of its tokens the verification accepted

    def draft(self, tokens: Sequence[int], n: int) -> DraftTree:
        """The draft tree after ``tokens[:n]`` (``n`` never decreases between calls)."""
        if n > self._n:
            self.own.extend(tokens[self._n:n])
            self._n = n
        context = tokens[max(0, n - self.depth + 1):n]
        own = self.own.speculate(context, self.max_len, self.min_match)
        cached = self.cache.index(self.scope)
        shared = (cached.speculate(context, self.max_len, self.min_match) if cached is not None
                  else own)
        self.from_cache = shared.score > own.score
        return (shared if self.from_cache else own).tree


class SuffixShadow:
    """The shadow proposer of suffix decoding (``pace.Shadow``): its own ``SuffixIndex``
    over the committed text up to each step's x, and the shared cache as it is now."""

    prior_gain = 1.0

    def __init__(self, depth: int, min_match: int, max_len: int, cache: ResponseCache,
                 scope: str | None = None) -> None:
        self.depth = max_len
        self.index = SuffixIndex(depth, min_match, max_len, cache, scope)

    def candidates(self, ids: Sequence[int], pos: int) -> list[list[int]]:
        return self.index.draft(ids, pos + 1).paths()


class SuffixWorker(TreeWorker):
    """Suffix decoding's host worker: each request's ``SuffixIndex`` proposes a tree of up
    to max_draft_len tokens (the request's own ``max_draft_len`` when it sends one),
    verified by ``walk_tree``; finished requests' responses go into the shared
    ``ResponseCache``."""

    name = "suffix"
    trees = True

    def __init__(self, max_draft_len: int, depth: int, min_match: int, cache_requests: int
                 ) -> None:
        super().__init__(max_draft_len)
        self.depth, self.min_match = depth, min_match
        self.cache = ResponseCache(depth, cache_requests, min_match)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, device=None, draft=None) -> SuffixWorker:
        worker = cls(spec.max_draft_len, spec.suffix_tree_depth, spec.suffix_min_match,
                     spec.suffix_cache_requests)
        print(f"kiln: suffix decoding: a shared cache of up to {spec.suffix_cache_requests} "
              f"responses (~300 bytes a cached token), up to {spec.max_draft_len} draft "
              f"tokens per step after a match of {spec.suffix_min_match}+ (depth "
              f"{spec.suffix_tree_depth})", file=sys.stderr, flush=True)
        return worker

    def _max_len(self, req: Request) -> int:
        return req.params.max_draft_len or self.max_draft_len

    def init_request(self, req: Request, window: tuple[int, int, int]) -> None:
        req.spec_state = SuffixIndex(self.depth, self.min_match, self._max_len(req),
                                     self.cache, req.params.tenant)

    def shadow_proposer(self, req: Request) -> SuffixShadow:
        return SuffixShadow(self.depth, self.min_match, self._max_len(req), self.cache,
                            req.params.tenant)

    def verify(self, req: Request, logits: torch.Tensor, argmax: list[int]
               ) -> tuple[list[int], list[tuple[int, int]]]:
        accepted, moves, req.spec_state.matched = walk_tree(req, logits, argmax,
                                                            req.draft.data.children())
        return accepted, moves

    def on_commit(self, req: Request, num_new: int, verified: bool) -> None:
        super().on_commit(req, num_new, verified)
        st = req.spec_state
        if verified and st.from_cache:  # (the commit may stop short: max_tokens, a stop)
            req.metrics.spec_cached_tokens += min(st.matched, num_new)

    def release(self, req: Request) -> None:
        if req.is_finished and req.error is None:
            self.cache.add(req.all_token_ids[req.num_prompt_tokens:], req.params.tenant)
