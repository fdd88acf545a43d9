"""Group advantages: exact values on small cases, and properties for any finite rewards."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.algorithms.advantages import (
    EPS,
    METHODS,
    STD_SCALES,
    compute_advantages,
    uniform_group_rate,
)

finite = st.floats(allow_nan=False, allow_infinity=False)
unit = st.floats(min_value=0.0, max_value=1.0)
groups_of = lambda values, min_size=1: st.lists(  # noqa: E731
    st.lists(values, min_size=min_size, max_size=8), min_size=1, max_size=6)
settings.register_profile("retrain", deadline=None, max_examples=200)
settings.load_profile("retrain")


def approx(a, b, tol=1e-9):
    return all(math.isclose(x, y, rel_tol=tol, abs_tol=tol)
               for ga, gb in zip(a, b, strict=True) for x, y in zip(ga, gb, strict=True))


def test_grpo_group_values():
    a = 0.5 / (0.5 + EPS)
    assert approx(compute_advantages([[1.0, 0.0, 0.0, 1.0]], "grpo"), [[a, -a, -a, a]])


def test_grpo_batch_and_none_scales():
    rewards = [[1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
    flat = [r for g in rewards for r in g]
    m = sum(flat) / len(flat)
    batch_std = math.sqrt(sum((r - m) ** 2 for r in flat) / len(flat))
    out = compute_advantages(rewards, "grpo", "batch")
    assert approx(out, [[0.5 / (batch_std + EPS), -0.5 / (batch_std + EPS)],
                        [x / (batch_std + EPS) for x in (0.25, 0.25, 0.25, -0.75)]])
    assert approx(compute_advantages(rewards, "grpo", "none"),
                  [[0.5, -0.5], [0.25, 0.25, 0.25, -0.75]])


def test_dr_grpo_ignores_std_scale():
    rewards = [[3.0, 1.0, 2.0]]
    for scale in STD_SCALES:
        assert approx(compute_advantages(rewards, "dr_grpo", scale), [[1.0, -1.0, 0.0]])


def test_rloo_values():
    assert approx(compute_advantages([[1.0, 0.0, 0.0, 0.0]], "rloo"),
                  [[1.0, -1 / 3, -1 / 3, -1 / 3]])


def test_maxrl_is_success_count_normalised():
    # N = 4 samples, K = 1 success: weight N/K - 1 = 3 for the success, -1 for failures.
    assert approx(compute_advantages([[1.0, 0.0, 0.0, 0.0]], "maxrl"), [[3.0, -1.0, -1.0, -1.0]])
    # K = 2: 4/2 - 1 = 1.
    assert approx(compute_advantages([[1.0, 1.0, 0.0, 0.0]], "maxrl"), [[1.0, 1.0, -1.0, -1.0]])


def test_maxrl_nonpositive_mean_gives_zeros():
    assert compute_advantages([[-1.0, 0.0, 0.5]], "maxrl") == [[0.0, 0.0, 0.0]]


def test_reinforce_pp_batch_normalised():
    rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0, 1.0]]
    out = compute_advantages(rewards, "reinforce_pp")
    assert out[1] == [0.0, 0.0]
    flat = [a for g in out for a in g]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / len(flat))
    assert abs(mean) < 1e-9
    assert std == pytest.approx(1.0, abs=1e-4)  # (c - mu) / (sd + EPS) has std just under 1


@pytest.mark.parametrize("method", METHODS)
def test_size_one_groups_are_zero_and_uniform(method):
    rewards = [[1.0], [0.0], [0.3]]
    assert compute_advantages(rewards, method) == [[0.0], [0.0], [0.0]]
    assert uniform_group_rate(rewards) == 1.0


@pytest.mark.parametrize("method", METHODS)
def test_empty_input(method):
    assert compute_advantages([], method) == []
    assert compute_advantages([[]], method) == [[]]
    assert uniform_group_rate([]) == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown advantage method"):
        compute_advantages([[1.0, 0.0]], "ppo")
    with pytest.raises(ValueError, match="std_scale"):
        compute_advantages([[1.0, 0.0]], "grpo", "global")
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([[1.0, float("nan")]], "grpo")


def test_uniform_group_rate_counts_groups():
    assert uniform_group_rate([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5]]) == 0.75
    assert uniform_group_rate([[0.1 + 0.2, 0.3]]) == 1.0  # float noise is not signal


# ---------------------------------------------------------------------------- properties


@given(groups_of(finite), st.sampled_from(METHODS), st.sampled_from(STD_SCALES))
def test_shapes_preserved_and_finite(rewards, method, std_scale):
    out = compute_advantages(rewards, method, std_scale)
    assert [len(g) for g in out] == [len(g) for g in rewards]
    assert all(math.isfinite(a) for g in out for a in g)


@given(groups_of(finite), st.sampled_from(METHODS), st.sampled_from(STD_SCALES))
def test_uniform_groups_get_zeros(rewards, method, std_scale):
    rewards = rewards + [[rewards[0][0]] * len(rewards[-1])]  # append a uniform group
    out = compute_advantages(rewards, method, std_scale)
    assert out[-1] == [0.0] * len(rewards[-1])
    assert uniform_group_rate(rewards) > 0


@given(groups_of(st.floats(min_value=-1e6, max_value=1e6), min_size=2),
       st.sampled_from(STD_SCALES))
def test_grpo_zero_sum_per_group(rewards, std_scale):
    for g in compute_advantages(rewards, "grpo", std_scale):
        scale = max(1.0, max(abs(a) for a in g))
        assert abs(math.fsum(g)) <= 1e-9 * scale * len(g)


@given(groups_of(st.floats(min_value=-1e6, max_value=1e6), min_size=2))
def test_rloo_leave_one_out_identity(rewards):
    out = compute_advantages(rewards, "rloo")
    for g, adv in zip(rewards, out, strict=True):
        if max(g) - min(g) <= 1e-12 * max(1.0, *map(abs, g)):
            continue  # uniform: zeros by definition
        for i, a in enumerate(adv):
            others = g[:i] + g[i + 1:]
            expected = g[i] - math.fsum(others) / len(others)
            assert math.isclose(a, expected, rel_tol=1e-9, abs_tol=1e-6)


@given(groups_of(unit, min_size=2))
def test_methods_agree_on_sign(rewards):
    """Every method ranks completions within a group the same way as r - mean."""
    for method in METHODS:
        out = compute_advantages(rewards, method)
        for g, adv in zip(rewards, out, strict=True):
            m = math.fsum(g) / len(g)
            if max(g) - min(g) <= 1e-12:
                continue  # uniform: zeros
            for r, a in zip(g, adv, strict=True):
                if abs(r - m) > 1e-9:
                    assert a != 0.0 and (a > 0) == (r > m)


@given(st.lists(st.floats(min_value=-1.7e308, max_value=1.7e308), min_size=1, max_size=16))
def test_mean_and_std_are_finite_for_any_finite_rewards(values):
    """The trainer's reward statistics: 1e200 rewards once raised OverflowError at step 1."""
    from retrain.algorithms.advantages import mean_and_std

    mean, std = mean_and_std(values)
    assert math.isfinite(mean) and math.isfinite(std) and std >= 0
    assert min(values) <= mean <= max(values) or math.isclose(mean, min(values))


def test_mean_and_std_match_the_plain_formula_on_small_values():
    from retrain.algorithms.advantages import mean_and_std

    assert mean_and_std([1.0, 2.0, 3.0]) == (2.0, math.sqrt(2 / 3))
    assert mean_and_std([]) == (0.0, 0.0)
    mean, std = mean_and_std([1e200, -1e200])
    assert mean == 0.0 and math.isclose(std, 1e200)
