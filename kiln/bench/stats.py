"""Summary statistics for benchmark numbers (plain Python: no numpy, no torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks.

    Matches ``numpy.percentile(values, q)`` (method "linear"): rank ``q/100 * (n-1)`` in the
    sorted values, interpolated between its two neighbours.
    """
    if not values:
        raise ValueError("percentile of an empty list is undefined; pass at least one value")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q!r} must be in [0, 100]")
    xs = sorted(float(v) for v in values)
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    frac = rank - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99, min, max and std (population) of ``values``.

    An empty list gives NaN everywhere and ``count`` 0, so a report can still render it.
    """
    n = len(values)
    if n == 0:
        nan = float("nan")
        return {"count": 0, "mean": nan, "median": nan, "p90": nan, "p99": nan,
                "min": nan, "max": nan, "std": nan}
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    return {
        "count": n,
        "mean": mean,
        "median": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": float(min(values)),
        "max": float(max(values)),
        "std": math.sqrt(var),
    }


def tpot(e2e_s: float, ttft_s: float, num_output_tokens: int) -> float | None:
    """Time per output token after the first: ``(E2E - TTFT) / (n - 1)``.

    The first token's time is TTFT, so it is excluded. Undefined (None) for ``n < 2``.
    """
    if num_output_tokens < 2:
        return None
    if e2e_s < ttft_s:
        raise ValueError(f"e2e_s={e2e_s!r} is less than ttft_s={ttft_s!r}; E2E includes TTFT")
    return (e2e_s - ttft_s) / (num_output_tokens - 1)


def rate(count: float, seconds: float) -> float:
    """``count / seconds``, 0.0 when no time passed (never a ZeroDivisionError)."""
    return count / seconds if seconds > 0 else 0.0
