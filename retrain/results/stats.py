"""The statistics of `retrain compare` and of a race: a mean with its Student t interval across
seeds; the difference of two conditions as a paired t interval over the seeds both have (seed s
fixes the data order, the sampling stream and the adapter init, so two conditions' runs of one
seed share their luck), else Welch's interval of two means. scipy.stats does the distributions.
Pure: no I/O (floor 1, so the race's decisions use the same intervals). A sampled
evaluation's mean@k and pass@k are run/at_k.py's."""

from __future__ import annotations

import functools
import math
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
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
    """mean(condition) - mean(baseline) with its 95% interval (None when there is none) and the
    one-line verdict. `test` is "paired t" (over `seeds`, the seeds both sides have; `unpaired`
    are the seeds only one side has, left out) or "Welch" (every value, unpaired)."""

    metric: str
    diff: float | None
    lo: float | None
    hi: float | None
    df: float | None
    verdict: str
    test: str = ""
    seeds: tuple[int, ...] = ()
    unpaired: tuple[int, ...] = ()


def mean(values: list[float]) -> float:
    """The mean, never an OverflowError: finite values near the float limit (a reward of
    1e308) overflow a plain sum; scaled down they do not."""
    values, scale = _scaled(values)
    return math.fsum(values) / len(values) * scale


def trailing_means(values: Iterable[float], k: int) -> Iterator[float]:
    """For each value, `mean` of it and the k - 1 before it (fewer at the start), in one pass:
    the window's sum is kept exactly, as an integer count of 2**-1074 (every float is one), so
    each mean is the float `mean` gives, bit for bit, without summing the window again."""
    window: deque[int] = deque()
    raw: deque[float] = deque()
    total, big = 0, 0   # the window's exact sum; its values too large for the exact sum's route
    for x in values:
        num, den = x.as_integer_ratio()
        window.append(num * (_ULP_DENOMINATOR // den))
        raw.append(x)
        total += window[-1]
        big += abs(x) >= _BIG
        if len(window) > k:
            total -= window.popleft()
            big -= abs(raw.popleft()) >= _BIG
        # (int / int is correctly rounded, as fsum is: the same float; `mean` scales big values)
        yield mean(list(raw)) if big else total / _ULP_DENOMINATOR / len(window)


_ULP_DENOMINATOR = 2 ** 1074  # every finite float is an integer multiple of 2**-1074
_BIG = 2.0 ** 500             # where `mean` scales its values down (_scaled)


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


def difference(metric: str, values: list[tuple[int | None, float]],
               baseline: list[tuple[int | None, float]], name: str,
               baseline_name: str) -> Difference:
    """values - baseline, each a list of (seed, value): a paired t interval over the seeds both
    sides have when there are at least 2 of them, else Welch over every value."""
    ours = {s: v for s, v in values if s is not None}
    theirs = {s: v for s, v in baseline if s is not None}
    shared = sorted(ours.keys() & theirs.keys())
    if len(shared) >= 2:
        unpaired = tuple(sorted(ours.keys() ^ theirs.keys()))
        return paired(metric, [ours[s] for s in shared], [theirs[s] for s in shared],
                      name, baseline_name, seeds=tuple(shared), unpaired=unpaired)
    return welch(metric, [v for _, v in values], [v for _, v in baseline], name, baseline_name)


def paired(metric: str, values: list[float], baseline: list[float], name: str,
           baseline_name: str, seeds: tuple[int, ...] = (), unpaired: tuple[int, ...] = (),
           confidence: float = CONFIDENCE) -> Difference:
    """values[i] - baseline[i] (the same seed), as the paired t interval of the differences."""
    diff, lo, hi = paired_interval(values, baseline, confidence)
    how = f"paired t, seeds {_seed_list(seeds)}" if seeds else "paired t"
    if unpaired:
        how += f"; seed{'s' if len(unpaired) > 1 else ''} {_seed_list(unpaired)} unpaired, " \
               "left out"
    return Difference(metric, diff, lo, hi, float(len(values) - 1),
                      verdict(metric, diff, lo, hi, name, baseline_name, how), "paired t",
                      seeds, unpaired)


def paired_interval(values: list[float], baseline: list[float],
                    confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, lo, hi) of values[i] - baseline[i]: the t interval of the differences at
    `confidence`, with n - 1 degrees of freedom (n >= 2). Differences without spread give the
    point. Huge values are scaled so that the differences cannot overflow."""
    n = len(values)
    if n < 2 or len(baseline) != n:
        raise ValueError(f"a paired interval needs >= 2 pairs, got {n} and {len(baseline)}")
    both, scale = _scaled([*values, *baseline])
    diffs = [a - b for a, b in zip(both[:n], both[n:], strict=True)]
    centre = math.fsum(diffs) / n
    if _spread(diffs) == 0:
        return centre * scale, centre * scale, centre * scale
    sd = math.sqrt(math.fsum((d - centre) ** 2 for d in diffs) / (n - 1))
    half = t_quantile(n - 1, confidence) * sd / math.sqrt(n)
    return centre * scale, (centre - half) * scale, (centre + half) * scale


@functools.lru_cache(maxsize=4096)
def t_quantile(df: int, confidence: float) -> float:
    """The two-sided Student t critical value: P(|T_df| <= q) = confidence."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + confidence / 2, df))


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
    how = f"Welch, {len(values)} and {len(baseline)} seeds"
    if _spread(values) == 0 and _spread(baseline) == 0:  # identical seeds on both sides
        return Difference(metric, diff, diff, diff, None,
                          verdict(metric, diff, diff, diff, name, baseline_name, how), "Welch")
    from scipy import stats

    with warnings.catch_warnings():  # one side without spread is fine for Welch
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(ours, theirs, equal_var=False)
    ci = result.confidence_interval(CONFIDENCE)
    lo, hi, df = float(ci.low) * scale, float(ci.high) * scale, float(result.df)
    return Difference(metric, diff, lo, hi, df, verdict(metric, diff, lo, hi, name,
                                                        baseline_name, how), "Welch")


def _scaled(values: list[float]) -> tuple[list[float], float]:
    """(values / scale, scale): a power of two brings huge values down to at most 2 so that
    sums and squares cannot overflow (only values negligible beside the largest lose bits)."""
    big = max((abs(v) for v in values), default=0.0)
    if not math.isfinite(big) or big < 2.0 ** 500:
        return list(values), 1.0
    scale = 2.0 ** (math.frexp(big)[1] - 1)
    return [v / scale for v in values], scale


def verdict(metric: str, diff: float, lo: float, hi: float, name: str,
            baseline_name: str, how: str = "") -> str:
    """One line: the difference, its interval and the test that gave it (`how`), then which is
    higher, or that the interval spans 0."""
    span = f"{_signed(diff)} [{_signed(lo)}, {_signed(hi)}]" + (f" ({how})" if how else "")
    if lo <= 0 <= hi:
        return f"{metric} {span}: not distinguishable with these seeds"
    word = "higher" if diff > 0 else "lower"
    return f"{metric} {span}: {name} is {word} than {baseline_name}"


def _spread(values: list[float]) -> float:
    return max(values) - min(values)


def _signed(x: float) -> str:
    return f"{x:+.3g}"


def _seed_list(seeds: tuple[int, ...]) -> str:
    return ", ".join(str(s) for s in seeds)
