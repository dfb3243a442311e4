"""SpecPace: when a request pauses speculation and when it probes again."""

from __future__ import annotations

from kiln.runtime.speculative.pace import FIRST_PAUSE, MAX_PAUSE, MIN_STEPS, SpecPace


def test_pauses_after_min_steps_below_break_even_and_probes_again():
    p = SpecPace(break_even=1.5)
    for _ in range(MIN_STEPS - 1):
        p.on_spec_step(1)
        assert p.speculating  # too few steps to decide
    p.on_spec_step(1)
    assert not p.speculating and p.pause_left == FIRST_PAUSE
    for i in range(FIRST_PAUSE):
        assert not p.speculating, i
        p.on_plain_step()
    assert p.speculating and p.paused_steps == FIRST_PAUSE
    for _ in range(MIN_STEPS):  # the probe fails: the pause doubles
        p.on_spec_step(1)
    assert p.pause_left == 2 * FIRST_PAUSE


def test_paying_steps_never_pause_and_reset_the_backoff():
    p = SpecPace(break_even=1.5)
    for _ in range(50):
        p.on_spec_step(3)
        assert p.speculating
    p.next_pause = 128
    for _ in range(MIN_STEPS):
        p.on_spec_step(2)
    assert p.speculating and p.next_pause == FIRST_PAUSE


def test_the_mean_tolerates_bad_steps_and_the_pause_is_capped():
    p = SpecPace(break_even=1.5)
    for _ in range(MIN_STEPS // 2):
        p.on_spec_step(3)
    for _ in range(MIN_STEPS // 2):  # mean 2.0 >= 1.5
        p.on_spec_step(1)
    assert p.speculating
    for _ in range(2 * MIN_STEPS):  # the mean sinks below 1.5 after 13 more bad steps
        p.on_spec_step(1)
        if not p.speculating:
            break
    assert p.pause_left == FIRST_PAUSE
    p.pause_left, p.next_pause = 0, MAX_PAUSE
    for _ in range(MIN_STEPS):
        p.on_spec_step(1)
    assert p.pause_left == MAX_PAUSE and p.next_pause == MAX_PAUSE
    p.on_plain_step()
    assert p.pause_left == MAX_PAUSE - 1


def test_a_probe_is_judged_after_probe_steps_and_grows_the_pause(monkeypatch):
    from kiln.runtime.speculative import pace

    monkeypatch.setattr(pace, "MIN_STEPS", 6)
    monkeypatch.setattr(pace, "PROBE_STEPS", 2)
    monkeypatch.setattr(pace, "PAUSE_GROWTH", 4)
    p = SpecPace(break_even=1.5)
    for _ in range(6):
        assert p.speculating
        p.on_spec_step(1)
    assert p.pause_left == FIRST_PAUSE  # the first decision: after MIN_STEPS
    for _ in range(FIRST_PAUSE):
        p.on_plain_step()
    p.on_spec_step(1)
    assert p.speculating  # one probe step: too few to judge
    p.on_spec_step(1)
    assert p.pause_left == 4 * FIRST_PAUSE  # judged after PROBE_STEPS, the pause x4
    for _ in range(4 * FIRST_PAUSE):
        p.on_plain_step()
    p.on_spec_step(3)
    p.on_spec_step(2)
    assert p.speculating and p.next_pause == FIRST_PAUSE  # a probe that pays resets it


def test_an_early_decision_pauses_only_clear_losers(monkeypatch):
    from kiln.runtime.speculative import pace

    monkeypatch.setattr(pace, "EARLY_STEPS", 4)
    monkeypatch.setattr(pace, "EARLY_FRACTION", 0.5)
    loser = SpecPace(break_even=3.0)  # 4 steps at 1.25 < 0.5 x 3.0: paused at once
    for _ in range(3):
        loser.on_spec_step(1)
        assert loser.speculating
    loser.on_spec_step(2)
    assert loser.pause_left == FIRST_PAUSE
    unsure = SpecPace(break_even=3.0)  # 2.0 per step: below break-even, not a clear loser
    for _ in range(4):
        unsure.on_spec_step(2)
    assert unsure.speculating
    for _ in range(MIN_STEPS - 5):
        unsure.on_spec_step(2)
    assert unsure.speculating
    unsure.on_spec_step(2)  # MIN_STEPS reached, mean 2.0 < 3.0
    assert unsure.pause_left == FIRST_PAUSE
