"""retrain/results/stats.py: the paired t interval against scipy's ttest_rel on random data, at
compare's 95% and at a race's per-look confidences, and how `difference` picks its test."""

from __future__ import annotations

import pytest

stats = pytest.importorskip("scipy.stats")
np = pytest.importorskip("numpy")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from retrain.results.stats import (  # noqa: E402
    difference,
    mean,
    paired_interval,
    t_quantile,
    trailing_means,
)

values = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(values, values), min_size=2, max_size=30),
       st.sampled_from([0.5, 0.9, 0.95, 0.99, 0.999, 0.99995]))
def test_paired_interval_is_scipys_ttest_rel(pairs, confidence):
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    diffs = [x - y for x, y in pairs]
    mean, lo, hi = paired_interval(xs, ys, confidence)
    assert mean == pytest.approx(float(np.mean(diffs)), rel=1e-9, abs=1e-6)
    if max(diffs) - min(diffs) == 0:
        assert lo == hi == mean
        return
    ci = stats.ttest_rel(xs, ys).confidence_interval(confidence)
    if not np.isfinite(ci.low):  # scipy's own rounding gave up (spread near the float floor)
        return
    width = float(ci.high - ci.low)
    assert lo == pytest.approx(float(ci.low), rel=1e-7, abs=1e-9 * max(1.0, width))
    assert hi == pytest.approx(float(ci.high), rel=1e-7, abs=1e-9 * max(1.0, width))


def test_paired_interval_on_seeded_random_data_at_many_sizes():
    rng = np.random.default_rng(48)
    for n in (2, 3, 5, 10, 50):
        for _ in range(20):
            shared = rng.normal(0, 3, n)  # each seed's luck, common to both conditions
            xs = (1.0 + shared + rng.normal(0, 0.5, n)).tolist()
            ys = (shared + rng.normal(0, 0.5, n)).tolist()
            mean, lo, hi = paired_interval(xs, ys, 0.95)
            ci = stats.ttest_rel(xs, ys).confidence_interval(0.95)
            assert (lo, hi) == pytest.approx((ci.low, ci.high), rel=1e-10, abs=1e-12)


def test_t_quantile_is_the_two_sided_critical_value():
    assert t_quantile(2, 0.95) == pytest.approx(4.302652729911275)
    assert t_quantile(9, 0.999) == pytest.approx(float(stats.t.ppf(0.9995, 9)))


def test_a_paired_interval_needs_two_pairs():
    with pytest.raises(ValueError, match="needs >= 2 pairs"):
        paired_interval([1.0], [2.0])
    with pytest.raises(ValueError):
        paired_interval([1.0, 2.0], [2.0])


def test_difference_pairs_shared_seeds_and_falls_back_to_welch():
    a = [(1, 0.9), (2, 0.8), (3, 0.7)]
    b = [(1, 0.5), (2, 0.45), (3, 0.3)]
    d = difference("r", a, b, "a", "b")
    assert d.test == "paired t" and d.seeds == (1, 2, 3)
    ci = stats.ttest_rel([0.9, 0.8, 0.7], [0.5, 0.45, 0.3]).confidence_interval(0.95)
    assert (d.lo, d.hi) == pytest.approx((ci.low, ci.high))
    one_shared = difference("r", a, [(1, 0.5), (4, 0.2)], "a", "b")
    assert one_shared.test == "Welch" and one_shared.seeds == ()
    unseeded = difference("r", [(None, 0.9), (None, 0.8)], [(None, 0.1), (None, 0.3)], "a", "b")
    assert unseeded.test == "Welch"
    assert difference("r", [], b, "a", "b").verdict == "no r for a"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                          st.sampled_from([0.1, 0.2, 0.3, 1e308, -1e308, 5e-324])),
                min_size=1, max_size=40),
       st.integers(min_value=1, max_value=12))
def test_trailing_means_are_the_windows_means_bit_for_bit(values, k):
    """One pass with an exact running sum, and the very float `mean` gives for each window (a
    threshold equal to a run's final reward is reached by its last window, never missed by a
    rounding of the running sum)."""
    expected = [mean(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]
    assert list(trailing_means(values, k)) == expected
