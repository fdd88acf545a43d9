"""The sampler/trainer gap metrics of a step's row (run/step_row.py): the mean gap, its 95th
percentile and the k3 mismatch KL, against plain references computed with numpy."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from retrain.backends.base import Datum
from retrain.run.step_row import logprob_diff, mismatch

logps = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False)
token = st.tuples(logps, logps, st.booleans())   # (sampler, trainer, trained)


def datums_of(seqs: list[list[tuple[float, float, bool]]]):
    datums = [Datum(input_tokens=[0] * len(s), target_tokens=[0] * len(s),
                    logprobs=[old for old, _, _ in s], advantages=[0.0] * len(s),
                    mask=[1.0 if m else 0.0 for _, _, m in s]) for s in seqs]
    return datums, [[new for _, new, _ in s] for s in seqs]


@given(st.lists(st.lists(token, max_size=12), min_size=1, max_size=4))
def test_gap_metrics_match_numpy(seqs):
    datums, trainer = datums_of(seqs)
    gaps = np.array([new - old for s in seqs for old, new, m in s if m], dtype=np.float64)
    got = mismatch(datums, trainer)
    if gaps.size == 0:
        assert logprob_diff(datums, trainer) is None
        assert got == {"sampler_trainer_logprob_diff_p95": None,
                       "sampler_trainer_mismatch_kl": None}
        return
    assert math.isclose(logprob_diff(datums, trainer), np.abs(gaps).mean(), abs_tol=1e-9)
    p95 = np.percentile(np.abs(gaps), 95, method="inverted_cdf")
    assert math.isclose(got["sampler_trainer_logprob_diff_p95"], p95, abs_tol=1e-12)
    kl = np.mean(np.exp(gaps) - 1.0 - gaps)
    assert math.isclose(got["sampler_trainer_mismatch_kl"], kl, rel_tol=1e-9, abs_tol=1e-12)
    assert got["sampler_trainer_mismatch_kl"] >= 0.0


def test_same_policy_has_no_gap_and_one_far_token_shows_in_the_p95_not_the_mean():
    same = [[(-1.0, -1.0, True)] * 40]
    assert mismatch(*datums_of(same)) == {"sampler_trainer_logprob_diff_p95": 0.0,
                                          "sampler_trainer_mismatch_kl": 0.0}
    far = [[(-1.0, -1.0, True)] * 37 + [(-1.0, -3.0, True)] * 3]   # 3 of 40 tokens: 7.5%
    got = mismatch(*datums_of(far))
    assert logprob_diff(*datums_of(far)) == 3 * 2.0 / 40
    assert got["sampler_trainer_logprob_diff_p95"] == 2.0
    assert math.isclose(got["sampler_trainer_mismatch_kl"], 3 * (math.exp(-2.0) + 1.0) / 40)
