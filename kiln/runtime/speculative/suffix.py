"""Suffix decoding: drafts from a suffix tree over the request's own text and one over a
bounded cache of earlier responses (Oliaro et al., SuffixDecoding; Snowflake's Arctic
Inference), model-free.

Both trees are suffix tries of bounded depth D: every substring of at most D tokens is a
path from the root, and each node counts the occurrences of its string. A proposal matches
the longest suffixes of the request's last tokens (at least ``min_match``, at most D - 1)
and follows, from each match, the most frequent continuation while its cumulative
probability (each child's count over its siblings' total) stays >= ``MIN_TOKEN_PROB``, for at
most ``SPEC_FACTOR`` x the match length tokens: a longer match drafts more (the draft
adapts to the match), and match + draft <= D. The draft with the highest score (the sum of
its cumulative probabilities: the tokens it is expected to get accepted) wins, over the
request's tree and the shared cache's. The winner is verified as a chain, like prompt
lookup's (``NgramWorker.verify``: greedy longest accepted prefix + bonus token, sampled the
rejection rule).

The trees live on the host (as in Arctic Inference and vLLM): a request's tree grows by D
node updates per committed token; the shared cache takes a response when its request
finishes (aborted and failed requests are not kept) and evicts the oldest responses
beyond ``suffix_cache_requests``. A request that names a tenant (``SamplingParams.tenant``)
drafts from and feeds that tenant's tree only: acceptance timing would otherwise tell one
tenant whether another's continuation was seen before.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.request import Request
from kiln.runtime.speculative.ngram import NgramWorker

# Arctic Inference's defaults: a draft no longer than its match, of tokens whose cumulative
# probability is at least 0.1
SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1


class _Node:
    __slots__ = ("count", "total", "children")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the node's string (as a substring, its end counted)
        self.total = 0  # the children's counts summed: occurrences with a continuation
        self.children: dict[int, _Node] = {}


@dataclass
class Speculation:
    """A draft, its score (expected accepted tokens) and the match it followed."""

    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


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
        """The best draft after ``context``'s last tokens (see the module docstring)."""
        best = Speculation()
        for m in range(min(len(context), self.depth - 1), min_match - 1, -1):
            if best.score >= min(max_tokens, math.ceil(m * SPEC_FACTOR)):
                break  # no shorter match can draft enough to score higher
            node = self.find(context[len(context) - m:])
            if node is None or not node.children:
                continue
            budget = min(max_tokens, self.depth - m, math.ceil(m * SPEC_FACTOR))
            s = Speculation(match_len=m)
            prob = 1.0
            while node.children and len(s.tokens) < budget:
                tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
                prob *= child.count / node.total
                if prob < MIN_TOKEN_PROB:
                    break
                s.tokens.append(tok)
                s.score += prob
                node = child
            if s.score > best.score:
                best = s
        return best


class ResponseCache:
    """The shared cache of earlier responses: a ``SuffixTree`` per scope (None: the
    engine-wide one; a tenant's name: that tenant's), over at most ``max_requests``
    responses in all, the oldest evicted first whichever scope holds it. A scope's tree is
    dropped with its last response."""

    def __init__(self, depth: int, max_requests: int) -> None:
        self.depth = depth
        self.max_requests = max_requests
        self._trees: dict[str | None, SuffixTree] = {}
        self._responses: OrderedDict[int, tuple[str | None, list[int]]] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._responses)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for _, r in self._responses.values())

    @property
    def num_nodes(self) -> int:
        return sum(t.num_nodes for t in self._trees.values())

    def tree(self, scope: str | None) -> SuffixTree | None:
        """The tree of ``scope``'s responses, or None while it holds none."""
        return self._trees.get(scope)

    def add(self, tokens: Sequence[int], scope: str | None = None) -> None:
        if self.max_requests == 0 or not tokens:
            return
        tokens = list(tokens)
        tree = self._trees.get(scope)
        if tree is None:
            tree = self._trees[scope] = SuffixTree(self.depth)
        tree.extend(tokens, [])
        self._responses[self._next] = (scope, tokens)
        self._next += 1
        while len(self._responses) > self.max_requests:
            _, (old_scope, old) = self._responses.popitem(last=False)
            old_tree = self._trees[old_scope]
            old_tree.remove(old)
            if not old_tree.root.children:
                del self._trees[old_scope]


class SuffixIndex:
    """One request's suffix tree over its text (prompt + output), grown as tokens commit,
    and the proposal from it and the shared cache."""

    def __init__(self, depth: int, min_match: int, max_len: int, cache: ResponseCache,
                 scope: str | None = None) -> None:
        self.tree = SuffixTree(depth)
        self.min_match, self.max_len = min_match, max_len
        self.cache, self.scope = cache, scope  # drafts from the cache of ``scope`` only
        self._active: list[_Node] = []
        self._n = 0  # tokens[:_n] are in the tree

    def draft(self, tokens: Sequence[int], n: int) -> list[int]:
        """The draft after ``tokens[:n]`` (``n`` never decreases between calls)."""
        if n > self._n:
            self._active = self.tree.extend(tokens[self._n:n], self._active)
            self._n = n
        context = tokens[max(0, n - self.tree.depth + 1):n]
        own = self.tree.speculate(context, self.max_len, self.min_match)
        cached = self.cache.tree(self.scope)
        if cached is None:
            return own.tokens
        shared = cached.speculate(context, self.max_len, self.min_match)
        return (shared if shared.score > own.score else own).tokens


class SuffixShadow:
    """The shadow proposer of suffix decoding (``pace.Shadow``): its own ``SuffixIndex``
    over the committed text up to each step's x, and the shared cache as it is now."""

    prior_gain = 1.0

    def __init__(self, depth: int, min_match: int, max_len: int, cache: ResponseCache,
                 scope: str | None = None) -> None:
        self.depth = max_len
        self.index = SuffixIndex(depth, min_match, max_len, cache, scope)

    def candidates(self, ids: Sequence[int], pos: int) -> list[list[int]]:
        draft = self.index.draft(ids, pos + 1)
        return [draft] if draft else []


class SuffixWorker(NgramWorker):
    """Suffix decoding's host worker: each request's ``SuffixIndex`` proposes a chain of up
    to max_draft_len tokens (the request's own ``max_draft_len`` when it sends one),
    verified as prompt lookup's chains are; finished requests' responses go into the shared
    ``ResponseCache``."""

    name = "suffix"

    def __init__(self, max_draft_len: int, depth: int, min_match: int, cache_requests: int
                 ) -> None:
        super().__init__(max_draft_len, depth - 1, min_match)
        self.depth = depth
        self.cache = ResponseCache(depth, cache_requests)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, device=None, draft=None) -> SuffixWorker:
        worker = cls(spec.max_draft_len, spec.suffix_tree_depth, spec.suffix_min_match,
                     spec.suffix_cache_requests)
        print(f"kiln: suffix decoding: a shared cache of up to {spec.suffix_cache_requests} "
              f"responses (tree depth {spec.suffix_tree_depth}, ~{spec.suffix_tree_depth} "
              f"tree nodes per cached token), up to {spec.max_draft_len} draft tokens per "
              f"step after a match of {spec.suffix_min_match}+", file=sys.stderr, flush=True)
        return worker

    def _max_len(self, req: Request) -> int:
        return req.params.max_draft_len or self.max_draft_len

    def init_request(self, req: Request, window: tuple[int, int, int]) -> None:
        req.spec_state = SuffixIndex(self.depth, self.min_match, self._max_len(req),
                                     self.cache, req.params.tenant)

    def shadow_proposer(self, req: Request) -> SuffixShadow:
        return SuffixShadow(self.depth, self.min_match, self._max_len(req), self.cache,
                            req.params.tenant)

    def may_take_slot(self, req: Request) -> bool:
        return False  # host state only

    def release(self, req: Request) -> None:
        if req.is_finished and req.error is None:
            self.cache.add(req.all_token_ids[req.num_prompt_tokens:], req.params.tenant)
