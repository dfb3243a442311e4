from __future__ import annotations

import math

import pytest

from kiln.bench.stats import percentile, rate, summarize, tpot


def test_percentile_matches_linear_interpolation():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)  # order does not matter


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    xs = rng.random(37).tolist()
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_single_value_and_errors():
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s["count"] == 5
    assert s["mean"] == pytest.approx(3.0)
    assert s["median"] == pytest.approx(3.0)
    assert s["p90"] == pytest.approx(4.6)
    assert s["p99"] == pytest.approx(4.96)
    assert s["min"] == 1.0 and s["max"] == 5.0
    assert s["std"] == pytest.approx(math.sqrt(2.0))


def test_summarize_empty_is_nan():
    s = summarize([])
    assert s["count"] == 0
    assert math.isnan(s["mean"]) and math.isnan(s["p99"])


def test_tpot_formula():
    # 10 tokens: first at 0.5 s, the last 9 in the remaining 1.5 s
    assert tpot(2.0, 0.5, 10) == pytest.approx(1.5 / 9)
    assert tpot(1.0, 1.0, 2) == 0.0
    assert tpot(1.0, 0.2, 1) is None  # undefined for a single token
    assert tpot(1.0, 0.2, 0) is None
    with pytest.raises(ValueError, match="includes TTFT"):
        tpot(0.1, 0.2, 5)


def test_rate():
    assert rate(10, 2.0) == 5.0
    assert rate(10, 0.0) == 0.0
