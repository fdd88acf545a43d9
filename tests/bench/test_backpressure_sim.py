"""The back-pressure simulator's precision bounds (bench/backpressure/sim.py) and one short run."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.backpressure import sim
from retrain.config.sections import BackpressureConfig
from retrain.control.usl import UslSums, usl_throughput

MACHINE_C = (0.30, 1e-4, 1200.0)          # p* = 84: steep, well identified


def test_the_bound_matches_the_spread_of_real_fits():
    """At 1% noise least squares is close to efficient: the spread of log p* over many noisy
    fits is the Cramér-Rao bound, within sampling error (here ~10%)."""
    ps = [16, 48, 96, 192, 384] * 6
    noise, rng, logs = 0.01, random.Random(7), []
    for _ in range(300):
        sums = UslSums(len(ps), center=200.0, scale=184.0)
        for p in ps:
            x = usl_throughput(p, *MACHINE_C) * math.exp(noise * rng.gauss(0.0, 1.0))
            sums.add(p, p / x)
        logs.append(math.log(sums.fit().p_star))
    bound = sim.p_star_se(ps, MACHINE_C, noise)
    assert statistics.stdev(logs) == pytest.approx(bound, rel=0.2)
    assert sim.p_star_se(ps, MACHINE_C, 2 * noise) == pytest.approx(2 * bound)   # ∝ noise
    assert sim.p_star_se(ps * 4, MACHINE_C, noise) == pytest.approx(bound / 2)   # ∝ 1/√n


def test_no_placement_of_the_steps_beats_the_best_design():
    sizes = [16 * b for b in (1, 2, 3, 4, 6, 8, 11, 16)]
    best, support, steps = sim.best_design(sizes, MACHINE_C, 0.1, 30)
    assert sum(steps) == pytest.approx(30)
    rng = random.Random(3)
    for _ in range(200):
        design = [rng.choice(sizes) for _ in range(30)]
        if len(set(design)) >= 3:
            assert sim.p_star_se(design, MACHINE_C, 0.1) >= best * (1 - 1e-9)
    # ... and it is reached: the design it names, rounded to whole steps, comes close.
    rounded = [p for p, k in zip(support, steps, strict=True) for _ in range(round(k))]
    assert sim.p_star_se(rounded, MACHINE_C, 0.1) < best * math.sqrt(30 / len(rounded)) * 1.05


def test_no_bound_without_a_peak_or_without_noise():
    assert sim.p_star_se([16, 32, 64], (0.05, 0.0, 800.0), 0.1) is None
    assert sim.p_star_se([16, 32, 64], MACHINE_C, 0.0) is None
    assert sim.p_star_se([16, 16, 16], MACHINE_C, 0.1) is None          # one size: singular


def test_a_short_simulated_run_fills_every_column():
    cfg = BackpressureConfig(enabled=True)
    sc = sim.Scenario("hw", (0.02, 2e-5, 900.0), noise=0.05, after=(0.02, 8e-5, 900.0),
                      change_at=100, steps=200)
    res = sim.Result()
    sim.run(sc, 0, cfg, res)
    assert res.settle[0] <= 5 and res.recovery[0] <= 15
    assert 0.8 <= res.ratio[0] <= 1.2 and res.thr[0] > 0.9
    assert res.false_alarms == [0]          # the one alarm after the change is not false
    assert res.us[0] > 0 and 0 < res.se_first[0] < 0.2 and res.se_window[0] <= res.se_first[0]


@pytest.mark.parametrize("name", ["A noise 10%", "A noise 20%", "A 5%, 1 in 25 slow",
                                  "B noise 10%", "hw p* 221->111 10%", "hw sigma x4 5%",
                                  "OOM b>=8 (A), 10%", "RL completions /2 5%"])
def test_the_worst_of_60_seeds_keeps_95_percent_of_the_best_throughput(name):
    """Issue 26: the worst of 60 seeds of every noise, drift, OOM and RL scenario keeps 0.95
    of the best throughput (2026-11-25 before the refining and the ceiling test: OOM 10%
    0.915, hw 221->111 10% 0.933; at 20 seeds A 20% was 0.931 and OOM 10% 0.847 on
    2026-11-23), and after a hardware change every seed ends on its own refit's target
    (p/own 1, issue 16)."""
    cfg = BackpressureConfig(enabled=True)
    sc = next(s for s in sim.scenarios() if s.name == name)
    res = sim.Result()
    for seed in range(60):
        sim.run(sc, seed, cfg, res)
    assert min(res.thr) >= 0.95
    if sc.after is not None:
        assert res.own == [1.0] * 60


def test_the_estimated_se_of_p_star_matches_the_bound_and_the_spread():
    """At 1% noise the controller's own SE of log p* (from its fit's residuals) is the
    Cramér-Rao bound and the spread of log p* over many noisy fits, within sampling error."""
    ps = [16, 48, 96, 192, 384] * 6
    rng, logs, ses = random.Random(7), [], []
    for _ in range(200):
        sums = UslSums(len(ps), center=200.0, scale=184.0)
        for p in ps:
            sums.add(p, p / (usl_throughput(p, *MACHINE_C) * math.exp(0.01 * rng.gauss(0, 1))))
        fit = sums.fit()
        logs.append(math.log(fit.p_star))
        ses.append(sums.log_p_star_se(fit))
    bound = sim.p_star_se(ps, MACHINE_C, 0.01)
    assert statistics.median(ses) == pytest.approx(bound, rel=0.1)
    assert statistics.stdev(logs) == pytest.approx(statistics.median(ses), rel=0.2)


def test_a_noisy_re_exploration_refines_p_star_and_a_quiet_one_does_not():
    cfg = BackpressureConfig(enabled=True)
    for noise, refines in ((0.10, True), (0.0, False)):
        sc = sim.Scenario("hw", (0.02, 2e-5, 900.0), noise=noise, after=(0.02, 8e-5, 900.0),
                          steps=200)
        rng = random.Random(3)
        ctl = sim.BackpressureController(cfg, sim.GROUP)
        b, reasons = ctl.first_batch_size(8), []
        for step in range(sc.steps):
            usl = sc.after if step >= sc.change_at else sc.usl
            x = usl_throughput(b * sim.GROUP, *usl) * math.exp(noise * rng.gauss(0.0, 1.0))
            d = ctl.observe(b, b * sim.GROUP * 300, b * sim.GROUP * 300 / x)
            reasons.append(d.reason)
            b = d.batch_size
        late = [r for r in reasons[sc.change_at:] if r.startswith("refining")]
        assert (len(late) > 0) == refines and len(late) <= 5


def test_rl_drift_raises_no_alarm_with_the_work_counted():
    cfg = BackpressureConfig(enabled=True)
    counted, raw = sim.Result(), sim.Result()
    for sc, res in zip([s for s in sim.scenarios() if s.halve_at is not None], (counted, raw),
                       strict=True):
        for seed in range(5):
            sim.run(sc, seed, cfg, res)
    assert sum(counted.false_alarms) == 0 and sum(raw.false_alarms) >= 5
