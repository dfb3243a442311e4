"""Adaptive speculation: a request stops speculating while speculation does not pay.

A speculative step costs more than a plain decode step: a lookahead (7,7,7) step on
smollm2-135m takes 1.47-1.57 ms of wall time (graph replay 1.04 ms plus host work a
speculative step cannot hide) against 0.56 ms for a decode step, so it pays only while it commits more than ~2.6-2.9 tokens.
Chat prompts commit ~1.2: always speculating made them ~50 % slower than plain decoding.

``SpecPace`` tracks one request's committed tokens per speculative step (the mean over the
steps since it last (re)started speculating). After ``MIN_STEPS`` such steps with a mean
below ``break_even`` it pauses: the next ``pause_left`` steps decode plainly (and
may run ahead under async scheduling), then it probes again, judged after ``PROBE_STEPS``.
Each failed probe multiplies the pause by ``PAUSE_GROWTH`` (up to ``MAX_PAUSE``); a probe
that pays resets it.

Output is unchanged by pacing: greedy verification commits plain greedy's tokens and
sampled verification is exact in distribution. Seeded requests are not paced (the engine
skips them): the measured break-even varies between runs, and a seed must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_STEPS = 12  # speculative steps measured before a pause is decided (4 paused code
# prompts early, while their n-gram pools were still filling)
PROBE_STEPS = 12  # the same for a probe (speculation restarted after a pause)
FIRST_PAUSE = 16  # plain steps of the first pause
PAUSE_GROWTH = 2  # each failed probe multiplies the pause by this
MAX_PAUSE = 256
EARLY_STEPS = 0  # > 0: after this many speculative steps, pause at once when the mean is
EARLY_FRACTION = 0.5  # below this fraction of the break-even (0: no early decision)


@dataclass
class SpecPace:
    """One request's pacing; ``break_even``: committed tokens per speculative step at which
    a speculative step costs what the same tokens cost in plain decode steps."""

    break_even: float
    tokens: int = 0  # tokens committed by the speculative steps since (re)start
    steps: int = 0  # speculative steps since speculation (re)started
    pause_left: int = 0  # plain steps to run before speculating again
    next_pause: int = FIRST_PAUSE
    paused_steps: int = 0  # plain steps run while paused, over the request's life

    @property
    def speculating(self) -> bool:
        return self.pause_left == 0

    def on_spec_step(self, committed: int) -> None:
        """After a verified speculative step that committed ``committed`` tokens."""
        self.tokens += committed
        self.steps += 1
        early = (self.steps == EARLY_STEPS
                 and self.tokens < EARLY_FRACTION * self.break_even * self.steps)
        if self.steps < (PROBE_STEPS if self.paused_steps else MIN_STEPS) and not early:
            return
        if early or self.tokens < self.break_even * self.steps:
            self.pause_left = self.next_pause
            self.next_pause = min(PAUSE_GROWTH * self.next_pause, MAX_PAUSE)
            self.tokens = self.steps = 0
        else:
            self.next_pause = FIRST_PAUSE

    def on_plain_step(self) -> None:
        """After a plain decode step of the request (one committed token)."""
        if self.pause_left:
            self.pause_left -= 1
            self.paused_steps += 1
