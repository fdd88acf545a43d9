"""run/at_k.py: mean@k, pass@k and the standard error of mean@k, by hand and against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.run.at_k import AtK, at_k


def test_at_k_by_hand():
    """3 problems, k = 4: rates 1/4, 0, 1 -> mean@4 = 5/12; pass@4 = 2/3 (the second problem
    no sample solves); the rates' sample variance is ((1/4 - 5/12)^2 + (5/12)^2 + (7/12)^2) / 2
    = 13/48, so the standard error is sqrt(13/48 / 3) = sqrt(13) / 12."""
    got = at_k([[True, False, False, False], [False] * 4, [True] * 4])
    assert (got.k, got.problems) == (4, 3)
    assert got.mean_at_k == pytest.approx(5 / 12)
    assert got.pass_at_k == pytest.approx(2 / 3)
    assert got.mean_at_k_se == pytest.approx(13 ** 0.5 / 12)
    assert at_k([[True, False]]).mean_at_k_se is None  # one problem: no error to give
    assert at_k([]) == AtK(0, 0, 0.0, 0.0, None)
    with pytest.raises(ValueError):
        at_k([[True], [True, False]])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 8).flatmap(lambda k: st.lists(st.lists(st.booleans(), min_size=k,
                                                              max_size=k), min_size=1,
                                                     max_size=20)))
def test_at_k_against_numpy(successes):
    """mean@k is the mean of per-problem rates, pass@k the share with any success, the error
    numpy's sample standard deviation over sqrt(problems); k = 1 is the greedy accuracy."""
    got, rates = at_k(successes), np.mean(successes, axis=1)
    assert got.mean_at_k == pytest.approx(float(rates.mean()))
    assert got.pass_at_k == pytest.approx(float(np.any(successes, axis=1).mean()))
    assert got.mean_at_k <= got.pass_at_k
    if len(successes) > 1:
        want = float(rates.std(ddof=1) / np.sqrt(len(successes)))
        assert got.mean_at_k_se == pytest.approx(want, abs=1e-12)
    if len(successes[0]) == 1:
        assert got.mean_at_k == got.pass_at_k
