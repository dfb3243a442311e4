"""Adaptive speculation: the break-even curve, the shadow replay of speculative steps and
the decisions SpecPace makes from them."""

import pytest
from helpers import find_draft

from kiln.runtime.speculative.lookahead import PoolShadow
from kiln.runtime.speculative.lookahead_math import NgramPool
from kiln.runtime.speculative.ngram import LookupIndex, LookupShadow
from kiln.runtime.speculative.pace import (
    MIN_REAL,
    MIN_SHADOW,
    PRIOR_GAIN,
    WINDOW,
    BreakEven,
    Shadow,
    SpecPace,
)


def test_break_even_is_linear_between_and_beyond_its_points():
    be = BreakEven(((8, 4.0), (1, 2.6)))  # sorted on construction
    assert be.points == ((1, 2.6), (8, 4.0))
    assert be.at(1) == pytest.approx(2.6) and be.at(8) == pytest.approx(4.0)
    assert be.at(4) == pytest.approx(2.6 + 1.4 * 3 / 7)
    assert be.at(15) == pytest.approx(5.4)  # extrapolated: larger batches cost more
    assert BreakEven(((1, 1.5),)).at(64) == 1.5
    be.batch = 8
    assert be.current == pytest.approx(4.0)
    assert be.to_json() == {"1": 2.6, "8": 4.0}
    three = BreakEven(((1, 2.0), (4, 2.0), (8, 6.0)))
    assert three.at(2) == 2.0 and three.at(6) == pytest.approx(4.0)
    for bad in ((), ((0, 2.0),), ((1, 0.0),)):
        with pytest.raises(ValueError, match="break-even points"):
            BreakEven(bad)


class Scripted:
    """A proposer that offers fixed candidates at given positions."""

    depth = 3

    def __init__(self, cands):
        self.cands = cands
        self.asked = []

    def candidates(self, ids, pos):
        self.asked.append((pos, len(ids)))
        return self.cands.get(pos, [])


def test_shadow_replays_only_steps_whose_drafts_can_be_checked():
    ids = [9, 9, 1, 2, 3, 4, 5, 6, 7, 8]  # prompt [9, 9], then the output
    prop = Scripted({2: [(2, 3, 0), (2, 9)], 5: [(5, 6, 7)]})
    sh = Shadow(prop, start=2)
    sh.update(ids[:5])  # x at 2 needs 3 tokens after it: none replayed yet
    assert sh.steps == 0 and sh.mean() is None
    sh.update(ids[:6])
    assert sh.steps == 1 and list(sh.recent) == [3]  # (2, 3) matched, then the bonus
    sh.update(ids)  # x at 5: all 3 drafts match -> 4 tokens; x at 9: not checkable
    assert list(sh.recent) == [3, 4] and sh.pos == 9
    assert sh.mean() == pytest.approx(3.5)
    assert [p for p, _ in prop.asked] == [2, 5]
    assert all(n == len(ids) or n == 6 for _, n in prop.asked)


def test_the_shadow_mean_is_over_the_last_window_steps():
    sh = Shadow(Scripted({}), start=0)
    sh.update(list(range(MIN_SHADOW - 1 + 3)))
    assert sh.steps == MIN_SHADOW - 1 and sh.mean() is None
    sh.update(list(range(WINDOW + 40)))
    assert sh.steps == WINDOW + 40 - 3 and len(sh.recent) == WINDOW and sh.mean() == 1.0


def test_pool_shadow_sees_only_ngrams_up_to_each_steps_x():
    """The pool of the replayed step at pos holds the prompt's n-grams and those ending at or
    before pos; the ones after it (the future the step is checked against) are not in it."""
    prompt = [5, 6, 7, 8]
    ids = prompt + [1, 2, 1, 2, 3, 1, 2, 3]
    prop = PoolShadow(n=3, g=2, prompt=prompt)
    ref = NgramPool(3, 2)
    ref.seed_from_tokens(prompt)
    for pos in range(len(prompt), len(ids) - 2):
        if pos >= 2:
            ref.add(ids[pos - 2 : pos + 1])
        assert prop.candidates(ids, pos) == ref.candidates(ids[pos], 2), pos
    fresh = PoolShadow(3, 2, prompt)
    assert fresh.candidates(ids, 4) == []  # [1, 2, 1] ends at 6: the future of pos 4
    assert fresh.candidates(ids, 9) == [(2, 3), (2, 1)]  # both 1-keyed, most recent first


def test_lookup_shadow_is_find_draft_over_the_text_up_to_x():
    ids = [1, 2, 3, 4, 1, 2, 3, 9]
    prop = LookupShadow(max_match=2, min_match=1, max_len=3)
    assert prop.depth == 3
    assert prop.candidates(ids, 5) == [find_draft(ids[:6], 2, 1, 3)] == [[3, 4, 1]]
    assert LookupShadow(max_match=2, min_match=1, max_len=3).candidates([1, 2], 1) == []


@pytest.mark.parametrize("seed", range(40))
def test_lookup_index_is_find_draft_as_the_text_grows(seed):
    """``LookupIndex.draft(tokens, n)`` (what proposals and the shadow call, every step)
    equals the scan ``find_draft(tokens[:n])`` at every n, however far n moves between
    calls, on texts with many repeats (small vocabularies) and few."""
    import random

    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 50])
    max_match = rng.randint(1, 4)
    min_match = rng.randint(1, max_match)
    max_len = rng.randint(1, 8)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
    index = LookupIndex(max_match, min_match, max_len)
    n = rng.randint(0, 3)
    while n <= len(tokens):
        want = find_draft(tokens[:n], max_match, min_match, max_len)
        assert index.draft(tokens, n) == want, (n, tokens[:n])
        assert index.draft(tokens, n) == want  # asked again at the same n
        n += rng.choice([1, 1, 1, 2, 5])


class FixedShadow:
    """A shadow whose mean is set by the test; counts its updates."""

    def __init__(self, mean=None):
        self.value = mean
        self.updates = 0

    def update(self, ids):
        self.updates += 1

    def mean(self):
        return self.value


def test_a_request_starts_only_on_evidence_that_it_pays():
    be = BreakEven(((1, 2.0), (8, 4.0)))
    pace = SpecPace(FixedShadow(None), be)
    pace.on_plain_step([1])
    assert not pace.speculating  # no evidence yet: plain decoding
    pace.shadow.value = 1.99 / PRIOR_GAIN  # the prior stands for what the shadow misses
    pace.on_plain_step([1])
    assert not pace.speculating
    pace.shadow.value = 2.0 / PRIOR_GAIN
    pace.on_plain_step([1])
    assert pace.speculating and pace.starts == 1
    assert pace.shadow.updates == 3


def test_the_break_even_is_read_at_the_running_batch():
    be = BreakEven(((1, 2.0), (8, 4.0)))
    pace = SpecPace(FixedShadow(3.0 / PRIOR_GAIN), be)
    be.batch = 8
    pace.on_plain_step([1])
    assert not pace.speculating  # 3.0 pays at batch 1, not at batch 8
    be.batch = 1
    pace.on_plain_step([1])
    assert pace.speculating


def test_a_losing_run_stops_after_min_real_steps_and_learns_its_gain():
    be = BreakEven(((1, 2.0),))
    pace = SpecPace(FixedShadow(2.0), be, gain=1.0)
    pace.on_plain_step([1])
    assert pace.speculating
    for _ in range(MIN_REAL - 1):
        pace.on_spec_step(1, [1])
        assert pace.speculating  # too few real steps to judge
    pace.on_spec_step(2, [1])  # mean (3 x 1 + 2) / 4 = 1.25 < 2.0
    assert not pace.speculating
    assert pace.gain == pytest.approx(1.25 / 2.0)  # what the shadow overstated
    assert not pace.real  # the next run is judged on its own steps
    pace.on_plain_step([1])
    assert not pace.speculating  # 2.0 x 0.625 < 2.0: no restart on the same evidence
    pace.shadow.value = 3.2  # the text became predictable: 3.2 x 0.625 = 2.0
    pace.on_plain_step([1])
    assert pace.speculating and pace.starts == 2
    assert pace.spec_steps == MIN_REAL and pace.plain_steps == 3


def test_a_paying_run_keeps_speculating_and_the_gain_is_bounded():
    be = BreakEven(((1, 1.5),))
    pace = SpecPace(FixedShadow(1.6), be, gain=1.0)
    pace.on_plain_step([1])
    for _ in range(3 * WINDOW):
        pace.on_spec_step(6, [1])
        assert pace.speculating
    assert pace.gain == 2.0  # 6 / 1.6 capped
    assert len(pace.real) == WINDOW


def test_the_batch_speculates_only_when_its_gain_covers_everyones_cost():
    """One request that pays alone does not pay for a masked step of 8: the batch gate
    holds it until the speculating requests' extra tokens reach B x (break-even - 1)."""
    from kiln.runtime.speculative.pace import gate_batch

    be = BreakEven(((1, 2.0), (8, 2.0)))
    paces = [SpecPace(FixedShadow(4.0), be, gain=1.0) for _ in range(8)]
    for p in paces[:1]:
        p.on_plain_step([1])
    assert paces[0].speculating
    gate_batch(paces, 1, be)
    assert paces[0].active  # alone: 3 extra tokens >= 1 x (2 - 1)
    gate_batch(paces, 8, be)
    assert not any(p.active for p in paces)  # 3 < 8 x (2 - 1)
    assert paces[0].speculating  # its own decision stands; the batch holds it
    for p in paces[1:3]:
        p.on_plain_step([1])
    gate_batch(paces, 8, be)  # 3 x 3 = 9 >= 8
    assert [p.active for p in paces] == [True] * 3 + [False] * 5
    gate_batch(paces[:3] + [None], 8, be)  # an unpaced request speculates anyway
    assert all(p.active for p in paces[:3])
    paces[0].shadow.value = None  # no evidence counts as 1 token: nothing extra
    assert paces[0].estimate() == 1.0


def test_real_steps_replace_the_prior_in_the_gate_one_by_one():
    """What the gate sums for a speculating request moves from the shadow's estimate to the
    real mean one real step at a time, so a batch whose first masked steps disappoint
    stops after one of them, not after MIN_REAL."""
    from kiln.runtime.speculative.pace import gate_batch

    be = BreakEven(((1, 2.0), (8, 2.0)))
    paces = [SpecPace(FixedShadow(5.0), be, gain=1.0) for _ in range(8)]
    for p in paces[:2]:
        p.on_plain_step([1])
    gate_batch(paces, 8, be)  # 2 x (5 - 1) = 8 >= 8 x (2 - 1)
    assert paces[0].active and paces[1].active
    for p in paces[:2]:
        p.on_spec_step(1, [1])  # the copy ran out: one token each
    expect = (1 + 5.0 * (MIN_REAL - 1)) / MIN_REAL
    assert paces[0].estimate() == pytest.approx(expect)
    gate_batch(paces, 8, be)  # 2 x (4 - 1) = 6 < 8: closed after one real step
    assert not paces[0].active and paces[0].speculating  # its own rule still waits
    for _ in range(MIN_REAL - 1):
        paces[0].on_spec_step(3, [1])
    assert paces[0].estimate() == pytest.approx((1 + 3 * (MIN_REAL - 1)) / MIN_REAL)
    paces[0].on_spec_step(3, [1])  # more real steps than MIN_REAL: the real mean
    assert paces[0].estimate() == pytest.approx(sum(paces[0].real) / len(paces[0].real))


def test_requests_on_the_device_ride_along_in_the_gate():
    """A masked step pads every sequence to a full step, so requests whose state is on the
    device ride along once one speculates: their expected tokens count in the gate (it
    needs one speculating request), and a step they take while not speculating themselves
    feeds their shadow, not their real-step record."""
    from kiln.runtime.speculative.pace import gate_batch

    be = BreakEven(((1, 2.0), (8, 2.0)))
    paces = [SpecPace(FixedShadow(1.8), be, gain=1.0) for _ in range(8)]
    paces[0].shadow.value = 3.0
    paces[0].on_plain_step([1])
    assert paces[0].speculating and not paces[1].speculating
    gate_batch(paces, 8, be)  # alone: 2 < 8 x (2 - 1)
    assert not paces[0].active
    gate_batch(paces, 8, be, [True] * 8)  # riding along: 2 + 7 x 0.8 = 7.6 < 8
    assert not paces[0].active
    paces[1].shadow.value = 2.4
    gate_batch(paces, 8, be, [True] * 8)  # 2 + 1.4 + 6 x 0.8 = 8.2 >= 8
    assert all(p.batch_ok for p in paces) and paces[0].active and not paces[1].active
    gate_batch(paces, 8, be, [False] + [True] * 7)  # the speculator is not on the device:
    assert not paces[0].active  # no device plan runs, so nobody rides along
    for p in paces:  # nobody speculating: the gate stays shut whatever the riders expect
        p.speculating = False
    gate_batch(paces, 8, be, [True] * 8)
    assert not any(p.batch_ok for p in paces)
    rider = paces[2]
    rider.on_spec_step(4, [1])
    assert rider.spec_steps == 1 and not rider.real and rider.shadow.updates == 1


def test_draft_pace_stops_pauses_doubling_and_restarts_open_to_the_gate():
    """DraftPace (draft models: no shadow): speculating from the start, a run whose
    MIN_REAL real steps average below the break-even stops for FIRST_PAUSE plain steps,
    the next stop pauses twice as long; a request the batch gate holds back stops too;
    a restart is open to the next gate (a stale closed gate from the pause would stop it
    again at once: on the GPU, random-weight draft requests took 1 speculative step in
    128)."""
    from kiln.runtime.speculative.pace import DraftPace, gate_batch

    be = BreakEven(((1, 2.0),))
    p = DraftPace(be)
    assert p.active and p.estimate() == 2.0  # a first run is given its chance
    for _ in range(MIN_REAL):
        p.on_spec_step(1, [])
    assert not p.speculating and p.pause == DraftPace.FIRST_PAUSE
    gate_batch([p], 1, be)
    assert not p.batch_ok  # nobody wants to speculate: the gate is closed
    for _ in range(DraftPace.FIRST_PAUSE):
        p.on_plain_step([])
    assert p.speculating and p.starts == 2 and p.active  # open to the next gate
    p.on_plain_step([])  # a plain step before the gate ran again: still speculating
    assert p.speculating
    gate_batch([p], 1, be)
    assert p.batch_ok
    for _ in range(MIN_REAL):
        p.on_spec_step(1, [])
    assert p.pause == 2 * DraftPace.FIRST_PAUSE
    good = DraftPace(be)
    for _ in range(3 * MIN_REAL):
        good.on_spec_step(4, [])
    assert good.speculating and good.estimate() == 4.0
    held = DraftPace(be)
    held.on_spec_step(1, [])  # estimate (1 + 3 * 2) / 4 = 1.75 < 2: the gate closes
    gate_batch([held], 1, be)
    assert not held.batch_ok
    held.on_plain_step([])
    assert not held.speculating and held.pause == DraftPace.FIRST_PAUSE
