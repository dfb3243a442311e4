"""Lookahead decoding math: step layout and mask, n-gram pool, verification (CPU, pure).

Everything here is per sequence and independent of the model; the lookahead worker packs
these pieces into a batch. The in-step token order (LOOKAHEAD.md) for a window (W, N, G)
with committed last token x at position p:

    row 0                      x                                  position p
    rows 1 .. W-1              level 0, cols 1..W-1               p+1 .. p+W-1
    then levels 1 .. N-2       W cols each, (level l, col j)      p+l+j
    then g candidates          N-1 tokens each, token k (1-based) p+k

T = (W+g)(N-1) tokens for N > 1 (= tokens_per_step when g == G); T = 1 for N == 1.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class StepLayout:
    """Where each in-step token of one sequence sits and what it may attend to.

    position_offsets: LongTensor [T]   position minus p (the committed position of x).
    mask:             BoolTensor [T, T] True = query row may attend to key column inside
                                        the step; the cached prefix (< p) is always
                                        visible and is not part of this mask.
    window_rows:      LongTensor [L, W] in-step row of (level l, col j); L = max(N-1, 1);
                                        level 0 col 0 is x (row 0).
    candidate_rows:   LongTensor [g, N-1] in-step rows of candidate i's tokens 1..N-1.
    """

    w: int
    n: int
    g: int
    position_offsets: torch.Tensor
    mask: torch.Tensor
    window_rows: torch.Tensor
    candidate_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.position_offsets.numel())

    @cached_property
    def row_lists(self) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """(window_rows, last_level_rows, candidate_rows) as Python lists, made once per
        layout: verification reads them every step, and tensor element reads cost ~1 us each."""
        return (self.window_rows.tolist(), self.last_level_rows.tolist(),
                self.candidate_rows.tolist())

    @property
    def last_level_rows(self) -> torch.Tensor:
        """Rows [W] whose outputs are the new window tokens (level N-2; level 0 when N <= 2)."""
        return self.window_rows[-1]


def num_step_tokens(w: int, n: int, g: int) -> int:
    """T for one sequence: (W+g)(N-1) for N > 1, 1 for N == 1."""
    return (w + g) * (n - 1) if n > 1 else 1


@functools.lru_cache(maxsize=512)
def step_layout(w: int, n: int, g_actual: int) -> StepLayout:
    """``build_step_layout`` made once per (w, n, g_actual) per process and shared by every
    request (a layout is a pure function of its window; never mutate its tensors). Building
    one costs ~2 ms of Python on the host, which a per-request cache paid for each of the
    G + 1 candidate counts of every request, inside its decode steps."""
    return build_step_layout(w, n, g_actual)


def build_step_layout(w: int, n: int, g_actual: int) -> StepLayout:
    """Positions, mask and row indices for one step of one sequence (see module doc).

    g_actual may be smaller than the engine's G (fewer candidates in the pool).
    Mask rule: each row sees exactly one token per position from p to its own position,
    on its own chain: (level 0, col j) sees level-0 cols 0..j; (level l, col j) sees
    level-0 cols 0..j and (level r, col j) for r = 1..l; candidate token k sees x and its
    own candidate's tokens 1..k.
    """
    if w < 1 or n < 1 or g_actual < 0:
        raise ValueError(
            f"lookahead window ({w},{n},{g_actual}) is invalid: need w >= 1, n >= 1, g >= 0"
        )
    if n == 1 and (w != 1 or g_actual != 0):
        raise ValueError(
            f"lookahead window ({w},{n},{g_actual}) is invalid: n == 1 (plain decoding) "
            f"requires w == 1 and g == 0"
        )
    levels = max(n - 1, 1)
    t = num_step_tokens(w, n, g_actual)
    pos = torch.empty(t, dtype=torch.long)
    mask = torch.zeros(t, t, dtype=torch.bool)
    window = torch.empty(levels, w, dtype=torch.long)
    cands = torch.empty(g_actual, max(n - 1, 0), dtype=torch.long)

    # level 0: rows 0..W-1, causal among themselves
    for j in range(w):
        window[0, j] = j
        pos[j] = j
        mask[j, : j + 1] = True
    row = w
    for lvl in range(1, levels):
        for j in range(w):
            window[lvl, j] = row
            pos[row] = lvl + j
            mask[row, window[0, : j + 1]] = True  # level-0 cols 0..j
            mask[row, window[1 : lvl + 1, j]] = True  # own column, levels 1..lvl
            row += 1
    for i in range(g_actual):
        for k in range(n - 1):  # token k+1 of candidate i
            cands[i, k] = row
            pos[row] = k + 1
            mask[row, 0] = True
            mask[row, cands[i, : k + 1]] = True
            row += 1
    if row != t:
        raise RuntimeError(f"step layout for ({w},{n},{g_actual}) filled {row} rows, expected {t}")
    return StepLayout(w, n, g_actual, pos, mask, window, cands)


POOL_BUCKETS = 4096  # hash buckets of a request's n-gram pool (key token % buckets)


def initial_window(prompt: Sequence[int], w: int, n: int, seed: int | None) -> list[list[int]]:
    """A request's first Jacobi window [max(N-1, 1)][W]: prompt tokens drawn with
    ``random.Random(seed)`` (0 when the request has no seed), so a request starts from the
    same window on the host and on the device, and on every rank."""
    rng = random.Random(0 if seed is None else seed)
    return [[rng.choice(prompt) for _ in range(w)] for _ in range(max(n - 1, 1))]


class NgramPool:
    """n-gram pool of one request: a fixed-size table of (key, n-1 continuation tokens).

    The definition the device table (kiln/runtime/speculative/device_lookahead.py) keeps too,
    so host and device agree entry for entry: ``buckets`` buckets of ``g`` entries each; an
    n-gram goes to bucket ``key % buckets``. Adding an n-gram already in its bucket does
    nothing (deduplicated); otherwise it overwrites the bucket's entry at its write cursor
    (the oldest, once the bucket is full) and the cursor moves on. Keys that share a bucket
    share its ``g`` entries. ``candidates(key)`` lists the bucket's entries of that key, most
    recently written first. Seeded with the prompt's n-grams and fed with the n-grams the
    lookahead branch produces (and committed output).

    A ring per bucket, not a per-key LRU list (where re-adding an n-gram would make it the
    most recent): it needs no reordering, which lets the device insert W+N n-grams per step
    in place; order only breaks ties, since every candidate of a key is verified each step.
    """

    def __init__(self, n: int, g: int, buckets: int = POOL_BUCKETS) -> None:
        if n < 2 or g < 0 or buckets < 1:
            raise ValueError(
                f"NgramPool(n={n}, g={g}, buckets={buckets}) is invalid: need n >= 2, "
                f"g >= 0 and buckets >= 1"
            )
        self.n = n
        self.g = g
        self.buckets = buckets
        # bucket -> [entries (key, continuation) or None] and its write cursor
        self._table: dict[int, list[tuple[int, tuple[int, ...]] | None]] = {}
        self._cursor: dict[int, int] = {}

    def add(self, ngram: Sequence[int]) -> None:
        """Insert one n-gram (key followed by n-1 tokens)."""
        if len(ngram) != self.n:
            raise ValueError(
                f"n-gram {tuple(ngram)} has {len(ngram)} tokens, pool n is {self.n}"
            )
        if self.g:
            self._insert(ngram[0], tuple(ngram[1:]))

    def add_from(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Insert the n-grams of ``tokens`` that end at indices ``start .. end - 1``, in
        order (those that start before index 0 are skipped): what ``add`` of each does,
        without its per-call checks (this runs for every committed token)."""
        if not self.g:
            return
        n = self.n
        for e in range(max(start, n - 1), end):
            self._insert(tokens[e - n + 1], tuple(tokens[e - n + 2 : e + 1]))

    def _insert(self, key: int, cont: tuple[int, ...]) -> None:
        if type(key) is not int:  # tensor or numpy elements: the table holds Python ints
            key, cont = int(key), tuple(int(t) for t in cont)
        entry = (key, cont)
        h = key % self.buckets
        bucket = self._table.get(h)
        if bucket is None:
            bucket = self._table[h] = [None] * self.g
            c = 0
        elif entry in bucket:
            return
        else:
            c = self._cursor[h]
        bucket[c] = entry
        self._cursor[h] = c + 1 if c + 1 < self.g else 0

    def seed_from_tokens(self, tokens: Iterable[int]) -> None:
        """Insert every n-gram of ``tokens`` (e.g. the prompt) in order."""
        toks = [int(t) for t in tokens]
        self.add_from(toks, 0, len(toks))

    def candidates(self, key: int, g: int | None = None) -> list[tuple[int, ...]]:
        """Up to ``g`` (default: the pool's g) continuations of ``key``, most recent first."""
        key = int(key)
        h = key % self.buckets
        bucket = self._table.get(h)
        if bucket is None:
            return []
        c = self._cursor[h]
        # most recent first: the entries before the cursor, then those from it on
        newest_first = bucket[c - 1 :: -1] + bucket[: c - 1 : -1]
        out = [e[1] for e in newest_first if e is not None and e[0] == key]
        limit = self.g if g is None else g
        return out[: max(limit, 0)]

    def entries(self) -> tuple[list[int], list[int], list[tuple[int, ...]],
                               list[tuple[int, int]]]:
        """The filled entries as flat indices (bucket x g + entry), keys and continuations,
        and each used bucket's write cursor (bucket, cursor): the table without its empty
        cells (``DeviceLookahead.admit`` writes only these)."""
        g = self.g
        filled = [(h * g + i, e) for h, bucket in self._table.items()
                  for i, e in enumerate(bucket) if e is not None]
        return ([f for f, _ in filled], [e[0] for _, e in filled], [e[1] for _, e in filled],
                list(self._cursor.items()))

    def __len__(self) -> int:
        return sum(e is not None for b in self._table.values() for e in b)

    def __contains__(self, ngram: Sequence[int]) -> bool:
        key = int(ngram[0])
        b = self._table.get(key % self.buckets)
        return b is not None and (key, tuple(int(t) for t in ngram[1:])) in b


def with_lookup(cands: list[tuple[int, ...]], draft: Sequence[int], depth: int, g: int
                ) -> list[tuple[int, ...]]:
    """The pool's candidates of x with the prompt-lookup candidate in one of the G slots:
    ``draft`` (what followed the latest earlier match of the request's last tokens, x
    last; ``LookupIndex``) cut or padded with 0 to ``depth`` (N-1) tokens, after the pool's
    candidates, in the last slot when they fill all G. Nothing changes when the draft is
    empty or already a candidate."""
    if not draft or not g:
        return cands
    cand = tuple(int(t) for t in draft[:depth]) + (0,) * max(depth - len(draft), 0)
    if cand in cands:
        return cands
    return cands[: g - 1] + [cand]
