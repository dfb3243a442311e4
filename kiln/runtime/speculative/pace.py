"""Adaptive speculation: a request speculates only while speculation pays.

A speculative step costs more than a plain decode step (on smollm2-135m a lookahead (7,7,7)
step is ~2.4x a decode step at batch 1 and ~3-5x at batch 8), so it pays only while it
commits more tokens than that ratio: the break-even (``BreakEven``, measured at start-up
by ``break_even.spec_break_even`` at batch 1 and at a larger batch, and read at the
number of requests running now).

Deciding needs an estimate of what a request's speculative steps would commit. Running
speculative steps to find out (probes) costs the very time pacing is there to save: on chat
prompts, which commit ~1.2 tokens per step, probes alone kept speculation at 0.57-0.62x of
plain decoding. ``Shadow`` estimates it for free instead: on the host, from the tokens the
request commits in whatever mode it decodes, it replays the steps a speculative run would
have taken (proposing as the worker would from the committed text alone, verifying against
the tokens that really followed, which greedy decoding makes the same in both modes) and
counts what each would have committed.

``SpecPace`` then decides after each commit:
- a request that is not speculating starts when the shadow's recent mean, times the
  request's learned ``gain``, reaches the break-even. Before the shadow has ``MIN_SHADOW``
  replayed steps (the first ~n tokens) it decodes plainly;
- the batch speculates only when its requests' expected gain covers the cost of a masked
  step for all of them (``gate_batch``): one speculating request in a batch of 8 makes the
  whole step masked and synchronous;
- a speculating request stops when the mean of its last ``WINDOW`` real speculative steps
  (at least ``MIN_REAL``) falls below the break-even. Its ``gain`` (real over shadow, what
  the lookahead branch's n-grams add or what they evict) is learned while it speculates,
  so a request that stopped does not restart until its text becomes more predictable.

A request that never speculated has ``gain`` = its proposer's ``prior_gain``: for lookahead
``PRIOR_GAIN``, since the shadow cannot see what the lookahead branch would add and that
prior stands for it; for prompt lookup 1.0, since the shadow proposes exactly what the
worker would. The probe cost is bounded by
construction: a request speculates only on evidence that it pays, and a losing run stops
after ``MIN_REAL`` steps.

Output is unchanged by pacing: greedy verification commits plain greedy's tokens and
sampled verification is exact in distribution. Seeded requests are not paced (the engine
skips them): the measured break-even varies between runs, and a seed must reproduce.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

WINDOW = 8  # the recent steps (replayed or real) an estimate averages over
MIN_SHADOW = 2  # replayed steps before the first decision (until then: plain decoding)
MIN_REAL = 4  # real speculative steps before a speculating request may stop
PRIOR_GAIN = 1.1  # real / shadow committed tokens before the request has speculated
# (smollm2 (7,7,7), float32, the bundled prompts: 0.9-1.3 on grounded, 1.0-1.45 on code,
# 1.1 on chat; the lookahead branch adds most on code)
MIN_GAIN, MAX_GAIN = 0.5, 2.0  # the learned gain stays within these


@dataclass
class BreakEven:
    """Committed tokens per speculative step at which a step of the engine's window costs
    what the same tokens cost in plain decode steps, by batch size: ``points`` (batch size,
    ratio), linear between them and beyond the last two (one point: the same everywhere).
    ``batch`` is set by the engine each step (the requests running); ``current`` reads it."""

    points: tuple[tuple[int, float], ...]
    batch: int = 1

    def __post_init__(self) -> None:
        if not self.points or any(b < 1 or r <= 0 for b, r in self.points):
            raise ValueError(f"break-even points {self.points} must be (batch >= 1, "
                             "ratio > 0) pairs, at least one")
        self.points = tuple(sorted(self.points))
        self._cache: dict[int, float] = {}

    def at(self, batch: int) -> float:
        ratio = self._cache.get(batch)  # read at every commit of every paced request
        if ratio is None:
            ratio = self._cache[batch] = self._interpolate(batch)
        return ratio

    def _interpolate(self, batch: int) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        i = next((k for k in range(1, len(pts) - 1) if batch <= pts[k][0]), len(pts) - 1)
        (b0, r0), (b1, r1) = pts[i - 1], pts[i]
        return max(r0 + (r1 - r0) * (batch - b0) / (b1 - b0), 0.0) if b1 != b0 else r1

    @property
    def current(self) -> float:
        return self.at(self.batch)

    def to_json(self) -> dict[str, float]:
        return {str(b): round(r, 4) for b, r in self.points}


class ShadowProposer(Protocol):
    """What the worker would propose at ``ids[pos]`` from ``ids[: pos + 1]`` alone (the
    committed text up to that step's last token); called with increasing ``pos``."""

    depth: int  # tokens after x a proposal may draft
    prior_gain: float  # real / shadow committed tokens expected before any real step

    def candidates(self, ids: Sequence[int], pos: int) -> list[Sequence[int]]: ...


class Shadow:
    """The speculative steps a request would have taken over the tokens it committed,
    replayed on the host: ``update(ids)`` replays every step whose drafts can be checked
    (``depth`` tokens after its x committed); ``mean()`` is what the last ``WINDOW`` of them
    committed on average (None before ``MIN_SHADOW``)."""

    def __init__(self, proposer: ShadowProposer, start: int) -> None:
        self.proposer = proposer
        self.pos = start  # x of the next replayed step: the first token after the prompt
        self.recent: deque[int] = deque(maxlen=WINDOW)
        self.steps = 0

    def update(self, ids: Sequence[int]) -> None:
        depth = self.proposer.depth
        candidates = self.proposer.candidates
        pos = self.pos
        while pos + depth < len(ids):
            future = ids[pos + 1 : pos + 1 + depth]  # what the step's drafts are checked on
            best = 0
            for cand in candidates(ids, pos):
                m = 0
                for tok, actual in zip(cand, future):
                    if tok != actual:
                        break
                    m += 1
                if m > best:
                    best = m
            self.recent.append(1 + best)  # the accepted drafts and the bonus token
            self.steps += 1
            pos += 1 + best
        self.pos = pos

    def mean(self) -> float | None:
        if len(self.recent) < MIN_SHADOW:
            return None
        return sum(self.recent) / len(self.recent)


@dataclass
class SpecPace:
    """One request's pacing (see the module docstring)."""

    shadow: Shadow
    break_even: BreakEven
    speculating: bool = False
    gain: float = PRIOR_GAIN
    real: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    starts: int = 0  # times the request started speculating
    spec_steps: int = 0  # verified speculative steps, over the request's life
    plain_steps: int = 0  # plain decode steps, over the request's life

    batch_ok: bool = True  # the batch gate lets it speculate this step (``gate_batch``)

    @property
    def active(self) -> bool:
        """Whether the request speculates in the next step."""
        return self.speculating and self.batch_ok

    def estimate(self) -> float:
        """Committed tokens per speculative step expected now (what the batch gate sums):
        the shadow's mean times the gain, with each real step of the current run taking
        the place of one of ``MIN_REAL`` prior steps (the real mean from ``MIN_REAL`` real
        steps on). A run whose first real steps disappoint closes the gate at once instead
        of after ``MIN_REAL`` steps: at batch 8 each of them is a masked step of the whole
        batch, so waiting is what a wrong start costs."""
        est = self.shadow.mean()
        prior = 1.0 if est is None else est * self.gain
        k = len(self.real) if self.speculating else 0
        if k >= MIN_REAL:
            return sum(self.real) / k
        return (sum(self.real) + prior * (MIN_REAL - k)) / MIN_REAL if k else prior

    def on_spec_step(self, committed: int, ids: Sequence[int]) -> None:
        """After a verified speculative step that committed ``committed`` tokens (one the
        request took while not speculating itself, riding along in a device step of the
        batch, counts for the shadow only)."""
        self.spec_steps += 1
        if self.speculating:
            self.real.append(committed)
        self._decide(ids)

    def on_plain_step(self, ids: Sequence[int]) -> None:
        """After a plain step of the request that committed a token."""
        self.plain_steps += 1
        self._decide(ids)

    def _decide(self, ids: Sequence[int]) -> None:
        self.shadow.update(ids)
        be = self.break_even.current
        est = self.shadow.mean()
        if self.speculating:
            if len(self.real) < MIN_REAL:
                return
            real = sum(self.real) / len(self.real)
            if est is not None:
                self.gain = min(max(real / est, MIN_GAIN), MAX_GAIN)
            if real < be:
                self.speculating = False
                self.real.clear()
        elif est is not None and est * self.gain >= be:
            self.speculating = True
            self.starts += 1


def gate_batch(paces: list[SpecPace | None], batch: int, break_even: BreakEven,
               riders: Sequence[bool] | None = None) -> None:
    """The batch's speculative step pays only if what it gains covers what it costs
    everyone: a step with any speculating row is a masked step of the whole batch
    (``batch`` rows at ``break_even.at(batch)`` times a plain step's cost), so the requests
    that want to speculate (``speculating``) may (``batch_ok``) only while the sum of the
    expected extra tokens, estimate - 1, reaches batch x (break-even - 1). At batch 1 this
    is the request's own rule.
    ``paces``: one per running request that may speculate (None: not paced; if one of
    those runs, the step is masked anyway and every paced request may). ``riders`` (one
    per pace): requests whose state is on the device ride along in any masked step of the
    batch (the bucket pads every sequence to a full step, so their drafts cost nothing
    more), so once one of them speculates the others' expected tokens count too (the
    worker's ``propose_all`` gives them their plans)."""
    live = [p for p in paces if p is not None]
    if len(live) < len(paces):
        ok = True  # an unpaced request speculates whenever it can: the cost is paid
    else:
        batch = max(batch, 1)
        need = batch * (break_even.at(batch) - 1.0)
        ride = riders or [False] * len(paces)
        wanting = [p for p in live if p.speculating]
        counted = wanting
        if any(r and p.speculating for p, r in zip(paces, ride)):  # a device plan runs
            counted = wanting + [p for p, r in zip(paces, ride) if r and not p.speculating]
        ok = bool(wanting) and sum(p.estimate() - 1.0 for p in counted) >= need
    for p in live:
        p.batch_ok = ok


@dataclass
class DraftPace:
    """Pacing of a draft-model request (the same interface as ``SpecPace``). No shadow:
    what a draft model would propose is known only by running it. So a request speculates
    from its start, each run expected at the break-even until ``MIN_REAL`` real steps say
    otherwise; it stops when the mean of its last ``WINDOW`` real steps (at least
    ``MIN_REAL``) falls below the break-even, or when the batch gate keeps it from
    speculating (``gate_batch``: its expected gain does not cover the batch's cost), then
    decodes plainly for ``pause`` plain steps (``FIRST_PAUSE``, doubled at each stop up to
    ``MAX_PAUSE``; its draft catches up on those tokens in one chunk when it starts again)
    and tries again."""

    break_even: BreakEven
    speculating: bool = True
    real: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    starts: int = 1
    spec_steps: int = 0
    plain_steps: int = 0
    pause: int = 0  # plain steps left before the next start
    next_pause: int = 0  # the pause after the next stop (0: FIRST_PAUSE)
    batch_ok: bool = True

    FIRST_PAUSE = 16
    MAX_PAUSE = 256

    @property
    def active(self) -> bool:
        return self.speculating and self.batch_ok

    def estimate(self) -> float:
        """The run's real mean, with the break-even standing in for each of its first
        ``MIN_REAL`` steps not taken yet."""
        k = len(self.real)
        if k >= MIN_REAL:
            return sum(self.real) / k
        return (sum(self.real) + self.break_even.current * (MIN_REAL - k)) / MIN_REAL

    def on_spec_step(self, committed: int, ids: Sequence[int]) -> None:
        self.spec_steps += 1
        if not self.speculating:
            return
        self.real.append(committed)
        if len(self.real) >= MIN_REAL and (sum(self.real) / len(self.real)
                                           < self.break_even.current):
            self._stop()

    def on_plain_step(self, ids: Sequence[int]) -> None:
        self.plain_steps += 1
        if self.speculating:
            if not self.batch_ok:  # the batch gate judged the run: it does not pay
                self._stop()
            return
        self.pause -= 1
        if self.pause <= 0:
            self.speculating = True
            self.starts += 1
            # the gate's verdict was on the paused request: the next schedule gates it
            # again (a stale False would keep it out of the step and stop it at once)
            self.batch_ok = True

    def _stop(self) -> None:
        self.speculating = False
        self.real.clear()
        self.pause = self.next_pause or self.FIRST_PAUSE
        self.next_pause = min(2 * self.pause, self.MAX_PAUSE)
