"""The campaign concurrency controller (retrain/control/concurrency.py) over simulated endpoints
(bench/concurrency/sim.py): it finds throttle_margin * p* of any USL curve, cuts at once on
overload answers and recovers, and a saved state continues where it stopped."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.concurrency.sim import SCENARIOS, Endpoint, kappa_for, run
from retrain.control.concurrency import CUT, ConcurrencyController, Sample

INTERVALS = 200

curves = st.builds(lambda sigma, p_star: (sigma, kappa_for(p_star, sigma)),
                   st.floats(0.0, 0.2), st.floats(2.0, 40.0))


@settings(max_examples=40, deadline=None)
@given(curve=curves, noise=st.floats(0.0, 0.05), seed=st.integers(0, 10**6),
       start=st.integers(1, 64))
def test_finds_the_best_cap_of_any_curve(curve, noise, seed, start):
    ep = Endpoint(*curve)
    from bench.concurrency.sim import Scenario

    r = run(Scenario("h", ep, noise=noise), seed, INTERVALS, start=start)
    assert r["share"] >= 0.9, r["caps"][-40:]
    assert all(1 <= c <= 64 for c in r["caps"])


@settings(max_examples=40, deadline=None)
@given(curve=curves, fail_above=st.integers(1, 30), seed=st.integers(0, 10**6))
def test_overload_cuts_at_once_and_stays_rare(curve, fail_above, seed):
    ep = Endpoint(*curve, fail_above=fail_above)
    rng = random.Random(seed)
    ctl = ConcurrencyController(1, 64, 4, 0.85)
    errors = 0
    for _ in range(INTERVALS):
        before = ctl.cap
        s = ep.served(ctl.cap, rng, 0.05)
        d = ctl.observe(s)
        if s.errors:
            errors += 1
            assert d.cap <= max(1, int(before * CUT)) and "overload" in d.reason
    # one per doubling of the warm-up, then at most one per ceiling lift (every 30 intervals)
    assert errors <= 3 + INTERVALS // 30


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
def test_simulated_scenarios(sc):
    shares = [run(sc, seed, INTERVALS)["share"] for seed in range(5)]
    assert min(shares) >= 0.9, shares


def test_a_saved_state_continues_where_it_stopped():
    ep = Endpoint(0.02, kappa_for(12, 0.02))
    rng = random.Random(1)
    ctl = ConcurrencyController(1, 64, 4, 0.85)
    for _ in range(40):
        ctl.observe(ep.served(ctl.cap, rng, 0.05))
    again = ConcurrencyController(1, 64, 4, 0.85)
    again.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert again.cap == ctl.cap and again.phase == ctl.phase and again.cap >= 8
    for _ in range(20):
        s = ep.served(ctl.cap, rng, 0.05)
        assert again.observe(s) == ctl.observe(s)


def test_no_traffic_holds_and_bounds_are_checked():
    ctl = ConcurrencyController(2, 8, 100)
    assert ctl.cap == 8
    d = ctl.observe(Sample(in_flight=0.0, throughput=0.0))
    assert d.cap == 8 and "no traffic" in d.reason
    with pytest.raises(ValueError):
        ConcurrencyController(5, 4, 4)
