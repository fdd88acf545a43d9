"""The back-pressure simulator's precision bounds (bench/backpressure_sim.py) and one short run."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench import backpressure_sim as sim
from retrain.config import BackpressureConfig
from retrain.control.backpressure import UslSums, usl_throughput

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


@pytest.mark.parametrize("name", ["A noise 20%", "hw p* 221->111 10%", "OOM b>=8 (A), 10%",
                                  "hw sigma x4 5%"])
def test_the_worst_seed_keeps_95_percent_of_the_best_throughput(name):
    """The three scenarios whose worst seed was below 0.95 (0.931, 0.933, 0.847 with the
    controller of 2026-11-23), and the 4x rise of contention: every seed ends on its own
    refit's target (p/own 1) with at least 0.95 of the best throughput."""
    cfg = BackpressureConfig(enabled=True)
    sc = next(s for s in sim.scenarios() if s.name == name)
    res = sim.Result()
    for seed in range(20):
        sim.run(sc, seed, cfg, res)
    assert min(res.thr) >= 0.95
    if sc.after is not None:
        assert res.own == [1.0] * 20


def test_rl_drift_raises_no_alarm_with_the_work_counted():
    cfg = BackpressureConfig(enabled=True)
    counted, raw = sim.Result(), sim.Result()
    for sc, res in zip([s for s in sim.scenarios() if s.halve_at is not None], (counted, raw),
                       strict=True):
        for seed in range(5):
            sim.run(sc, seed, cfg, res)
    assert sum(counted.false_alarms) == 0 and sum(raw.false_alarms) >= 5
