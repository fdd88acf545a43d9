"""RL's drift must not fool the run controller: throughput counted in work (control/work.py)."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrain.config import BackpressureConfig
from retrain.control.backpressure import BackpressureController
from retrain.control.work import StepWork, WorkModel, fit_costs
from retrain.step_row import step_work

G = 8
ON = BackpressureConfig(enabled=True, max_batch_size=32)
PROMPT = 40                 # prompt tokens per sequence


def contention(p: int) -> float:
    """The machine's USL slowdown of the per-token work at concurrency p (p* = 221)."""
    return (1 + 0.02 * (p - 1) + 2e-5 * p * (p - 1)) / p


def rl_step(b: int, completion: float, trained: float, rng: random.Random,
            noise: float = 0.03, slower: float = 1.0) -> tuple[StepWork, float]:
    """One step on a machine with a fixed per-step cost (1 s) and per-token costs that
    contend: `completion` tokens per sequence on average, `trained` the share of groups
    that are not uniform."""
    p = b * G
    c = max(1, round(p * completion * math.exp(0.15 * rng.gauss(0, 1))))
    groups = sum(rng.random() < trained for _ in range(b))
    t_tokens = groups * G * (PROMPT + c / p)
    work = StepWork(p * PROMPT, c, round(t_tokens), groups)
    per_token = 0.0005 * p * PROMPT + 0.004 * c + 0.002 * t_tokens + 0.02 * groups
    t = (1.0 + per_token * contention(p) * 16) * slower * math.exp(noise * rng.gauss(0, 1))
    return work, t


def run(ctl: BackpressureController, phases, seed: int = 0, with_work: bool = True):
    """Run (steps, completion, trained share, slower) phases; return per-step decisions."""
    rng, b, out = random.Random(seed), ctl.first_batch_size(8), []
    for steps, completion, trained, slower in phases:
        for _ in range(steps):
            work, t = rl_step(b, completion, trained, rng, slower=slower)
            d = ctl.observe(b, work.sampled_tokens, t, work=work if with_work else None)
            out.append((b, d))
            b = d.batch_size
    return out


def after(decisions, k: int):
    return decisions[k:]


@pytest.mark.parametrize("seed", range(4))
def test_completions_halving_on_an_unchanged_machine_is_no_throttle(seed):
    ctl = BackpressureController(ON, G)
    got = run(ctl, [(80, 40.0, 0.8, 1.0), (120, 20.0, 0.8, 1.0)], seed)
    settled = got[79][1].batch_size
    later = after(got, 80)
    assert not any("drifted" in d.reason for _, d in later), [d.reason for _, d in later
                                                              if "drifted" in d.reason]
    assert min(b for b, _ in later) >= settled
    assert all(d.action != "throttle" for _, d in later)


@pytest.mark.parametrize("seed", range(3))
def test_groups_going_uniform_is_no_change_either(seed):
    """Most groups all correct: the steps train little and get faster; no re-exploration."""
    ctl = BackpressureController(ON, G)
    got = run(ctl, [(80, 40.0, 0.9, 1.0), (120, 30.0, 0.2, 1.0)], seed)
    settled = got[79][1].batch_size
    assert not any("drifted" in d.reason for _, d in after(got, 80))
    assert min(b for b, _ in after(got, 80)) >= settled


def test_a_machine_that_really_slows_down_is_still_seen():
    """The work model explains the mix, never a uniform slowdown: that still alarms."""
    ctl = BackpressureController(ON, G)
    got = run(ctl, [(80, 40.0, 0.8, 1.0), (30, 40.0, 0.8, 2.0)])
    assert any("drifted slower" in d.reason for _, d in after(got, 80))


def test_the_ratio_is_blind_to_a_uniform_change_of_costs():
    rng, model, scaled = random.Random(1), WorkModel(), WorkModel()
    for i in range(30):
        b = 1 + i % 8
        work, t = rl_step(b, 30.0, 0.7, rng)
        model.add(b * G, work, t)
        scaled.add(b * G, work, 3.0 * t)
    work, _ = rl_step(4, 15.0, 0.3, rng)
    assert model.equivalent_tokens(32, work) == pytest.approx(scaled.equivalent_tokens(32, work))
    assert model.equivalent_tokens(32, work) != work.sampled_tokens


def test_costs_are_recovered_and_never_negative():
    """Each p has its own constant (contention); the costs of the work are shared."""
    rng, steps, falling = random.Random(2), [], []
    for _ in range(120):
        p = rng.choice([8, 16, 64])
        f = (rng.uniform(100, 1000), rng.uniform(50, 2000), rng.uniform(0, 3000),
             float(rng.randint(0, 8)))
        steps.append((p, f, 0.01 * p + 0.001 * f[0] + 0.004 * f[1] + 0.05 * f[3]))
        falling.append((p, f, max(0.01, 1.0 - 0.0003 * f[2])))     # time falls with work
    assert fit_costs(steps) == pytest.approx([0.001, 0.004, 0.0, 0.05], rel=0.02, abs=2e-5)
    costs = fit_costs(falling)
    assert costs is not None and min(costs) >= 0.0


def test_the_work_model_survives_a_resume():
    ctl = BackpressureController(ON, G)
    run(ctl, [(40, 40.0, 0.8, 1.0)])
    resumed = BackpressureController(ON, G)
    assert resumed.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    a = run(ctl, [(30, 20.0, 0.8, 1.0)], seed=9)
    b = run(resumed, [(30, 20.0, 0.8, 1.0)], seed=9)
    assert [d for _, d in a] == [d for _, d in b]


def test_the_trainer_counts_the_work_of_a_step():
    sizes = [[(3, 4), (3, 6)], [(2, 1), (2, 1)]]     # (context, sampled) per episode
    work = step_work(sizes, [[0.5, -0.5], [0.0, 0.0]])    # group 2 is uniform
    assert work == StepWork(prompt_tokens=3 + 3 + 2 + 2, completion_tokens=12,
                            trained_tokens=(3 + 4) + (3 + 6), groups_trained=1)


counts = st.integers(0, 10**7)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 40), counts, counts, counts, counts,
                          st.floats(1e-4, 1e4)), max_size=60))
def test_any_work_gives_clean_decisions_and_a_json_state(obs):
    ctl = BackpressureController(ON, G)
    for b, prompt, completion, trained, groups, t in obs:
        work = StepWork(prompt, completion, trained, groups)
        d = ctl.observe(b, work.sampled_tokens, t, work=work)
        assert ON.min_batch_size <= d.batch_size <= ON.max_batch_size
        assert d.throughput is None or math.isfinite(d.throughput)
    json.dumps(ctl.state_dict(), allow_nan=False)
