"""Capacity formulas (pure): completions per step, total steps, parallelism, wall time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.control import capacity


def test_profiles():
    assert capacity.completions_per_step(8, 16) == 128
    assert capacity.completions_per_step(2, 8) == 16


def test_total_steps_is_runs_times_max_steps():
    assert capacity.total_steps([100] * 6) == 600
    assert capacity.total_steps([10, 20]) == 30
    assert capacity.total_steps([]) == 0


@pytest.mark.parametrize("parallel,workers,runs,expected", [
    (True, 2, 6, 2), (True, 12, 6, 6), (True, 0, 6, 6), (False, 12, 6, 1),
    (True, 4, 0, 0), (False, 4, 0, 0), (True, 1, 1, 1),
])
def test_effective_parallelism(parallel, workers, runs, expected):
    assert capacity.effective_parallelism(parallel, workers, runs) == expected


def test_wall_time_formula():
    # median_step_time * total_steps / effective_parallelism
    assert capacity.wall_time_s(12.0, 600, 2) == 3600.0
    assert capacity.wall_time_s(12.0, 0, 2) == 0.0
    assert capacity.wall_time_s(12.0, 10, 0) == 0.0


def test_median_ignores_junk():
    assert capacity.median_step_time([3.0, None, "x", float("nan"), 1.0, True, -2, 2]) == 2.0
    assert capacity.median_step_time([]) is None
    assert capacity.median_step_time([float("inf"), 0]) is None


@pytest.mark.parametrize("seconds,text", [
    (0, "0s"), (59.4, "59s"), (60, "1m 0s"), (3599, "59m 59s"), (3600, "1h 0m"),
    (86399, "23h 59m"), (90000, "1d 1h"), (-5, "0s"),
])
def test_human_duration(seconds, text):
    assert capacity.human_duration(seconds) == text


@given(st.booleans(), st.integers(0, 100), st.integers(0, 1000))
def test_parallelism_bounds(parallel, workers, runs):
    p = capacity.effective_parallelism(parallel, workers, runs)
    assert 0 <= p <= runs
    assert (p == 0) == (runs == 0)
    if not parallel and runs:
        assert p == 1


@given(st.floats(0.001, 1e4), st.integers(1, 10**6), st.integers(1, 64))
def test_more_workers_never_slower(step, steps, workers):
    one = capacity.wall_time_s(step, steps, 1)
    many = capacity.wall_time_s(step, steps, workers)
    assert many <= one
    assert math.isclose(many * workers, one, rel_tol=1e-9)


@given(st.lists(st.floats(0.001, 1e6), min_size=1, max_size=50))
def test_median_is_within_range(values):
    m = capacity.median_step_time(values)
    assert min(values) <= m <= max(values)
