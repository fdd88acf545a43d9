"""The statistics of `retrain compare`: a mean with its Student t interval across seeds, and
Welch's difference of two means with its interval. scipy.stats does the distributions."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """A mean across seeds and its 95% interval (lo/hi None when n < 2: no interval)."""

    n: int
    mean: float | None = None
    lo: float | None = None
    hi: float | None = None


@dataclass(frozen=True)
class Difference:
    """mean(condition) - mean(baseline), with Welch's 95% interval (None when either side has
    fewer than 2 values) and the one-line verdict."""

    metric: str
    diff: float | None
    lo: float | None
    hi: float | None
    df: float | None
    verdict: str


def mean(values: list[float]) -> float:
    """The mean, never an OverflowError: finite values near the float limit (a reward of
    1e308) overflow a plain sum; scaled down they do not."""
    values, scale = _scaled(values)
    return math.fsum(values) / len(values) * scale


def median(values: list[float]) -> float:
    """statistics.median, with the two middle values averaged without overflowing."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else mean(ordered[half - 1:half + 1])


def estimate(values: list[float]) -> Estimate:
    """Mean and Student t 95% interval; n = 1 has a mean and no interval."""
    n = len(values)
    if n == 0:
        return Estimate(0)
    if n == 1:
        return Estimate(1, mean(values))
    if _spread(values) == 0:  # identical seeds: the interval is the point
        return Estimate(n, values[0], values[0], values[0])
    from scipy import stats

    scaled, scale = _scaled(values)
    centre = math.fsum(scaled) / n
    lo, hi = stats.t.interval(CONFIDENCE, n - 1, loc=centre, scale=stats.sem(scaled))
    return Estimate(n, centre * scale, float(lo) * scale, float(hi) * scale)


def welch(metric: str, values: list[float], baseline: list[float], name: str,
          baseline_name: str) -> Difference:
    """Difference of means (values - baseline), Welch's interval and the verdict."""
    if not values or not baseline:
        missing = name if not values else baseline_name
        return Difference(metric, None, None, None, None, f"no {metric} for {missing}")
    both, scale = _scaled([*values, *baseline])
    ours, theirs = both[:len(values)], both[len(values):]
    diff = (math.fsum(ours) / len(ours) - math.fsum(theirs) / len(theirs)) * scale
    if len(values) < 2 or len(baseline) < 2:
        return Difference(metric, diff, None, None, None,
                          f"{_signed(diff)}, n = 1 on one side: no interval; more seeds needed")
    if _spread(values) == 0 and _spread(baseline) == 0:  # identical seeds on both sides
        return Difference(metric, diff, diff, diff, None,
                          verdict(metric, diff, diff, diff, name, baseline_name))
    from scipy import stats

    with warnings.catch_warnings():  # one side without spread is fine for Welch
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(ours, theirs, equal_var=False)
    ci = result.confidence_interval(CONFIDENCE)
    lo, hi, df = float(ci.low) * scale, float(ci.high) * scale, float(result.df)
    return Difference(metric, diff, lo, hi, df, verdict(metric, diff, lo, hi, name,
                                                        baseline_name))


def _scaled(values: list[float]) -> tuple[list[float], float]:
    """(values / scale, scale): a power of two brings huge values down to at most 2 so that
    sums and squares cannot overflow (only values negligible beside the largest lose bits)."""
    big = max((abs(v) for v in values), default=0.0)
    if not math.isfinite(big) or big < 2.0 ** 500:
        return list(values), 1.0
    scale = 2.0 ** (math.frexp(big)[1] - 1)
    return [v / scale for v in values], scale


def verdict(metric: str, diff: float, lo: float, hi: float, name: str,
            baseline_name: str) -> str:
    """One line: which is higher, or that the interval spans 0."""
    span = f"{_signed(diff)} [{_signed(lo)}, {_signed(hi)}]"
    if lo <= 0 <= hi:
        return f"{metric} {span}: not distinguishable with these seeds"
    word = "higher" if diff > 0 else "lower"
    return f"{metric} {span}: {name} is {word} than {baseline_name}"


def _spread(values: list[float]) -> float:
    return max(values) - min(values)


def _signed(x: float) -> str:
    return f"{x:+.3g}"
