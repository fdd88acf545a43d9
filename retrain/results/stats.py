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


def estimate(values: list[float]) -> Estimate:
    """Mean and Student t 95% interval; n = 1 has a mean and no interval."""
    n = len(values)
    if n == 0:
        return Estimate(0)
    mean = math.fsum(values) / n
    if n == 1:
        return Estimate(1, mean)
    if _spread(values) == 0:  # identical seeds: the interval is the point
        return Estimate(n, mean, mean, mean)
    from scipy import stats

    sem = stats.sem(values)
    lo, hi = stats.t.interval(CONFIDENCE, n - 1, loc=mean, scale=sem)
    return Estimate(n, mean, float(lo), float(hi))


def welch(metric: str, values: list[float], baseline: list[float], name: str,
          baseline_name: str) -> Difference:
    """Difference of means (values - baseline), Welch's interval and the verdict."""
    if not values or not baseline:
        missing = name if not values else baseline_name
        return Difference(metric, None, None, None, None, f"no {metric} for {missing}")
    diff = math.fsum(values) / len(values) - math.fsum(baseline) / len(baseline)
    if len(values) < 2 or len(baseline) < 2:
        return Difference(metric, diff, None, None, None,
                          f"{_signed(diff)}, n = 1 on one side: no interval; more seeds needed")
    if _spread(values) == 0 and _spread(baseline) == 0:  # identical seeds on both sides
        return Difference(metric, diff, diff, diff, None,
                          verdict(metric, diff, diff, diff, name, baseline_name))
    from scipy import stats

    with warnings.catch_warnings():  # one side without spread is fine for Welch
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(values, baseline, equal_var=False)
    ci = result.confidence_interval(CONFIDENCE)
    lo, hi, df = float(ci.low), float(ci.high), float(result.df)
    return Difference(metric, diff, lo, hi, df, verdict(metric, diff, lo, hi, name,
                                                        baseline_name))


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
