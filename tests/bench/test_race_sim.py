"""bench/campaign/race_sim.py drives the real race: its tallies on a few campaigns where the answer
is known (a huge effect is found with the fewest runs; equal conditions give no winner)."""

from __future__ import annotations

import pytest

pytest.importorskip("scipy")

from bench.campaign import race_sim  # noqa: E402


def test_a_huge_effect_is_found_at_the_first_look_by_race_and_grid():
    sc = race_sim.Scenario(3, 100.0, noise=0.1, luck=1.0)
    raced, grid = race_sim.simulate(sc, 20, seed=1)
    assert raced.found == grid.found == 20 and raced.false_elim == 0
    assert raced.runs == 20 * 3 * 3 and grid.runs == 20 * 3 * 10  # 3 seeds each vs all 10
    assert race_sim.row(sc, raced, grid).endswith("| 30.0% |")


def test_equal_conditions_rarely_give_a_verdict_and_the_bound_is_clopper_pearson():
    sc = race_sim.Scenario(2, 0.0)
    raced, _ = race_sim.simulate(sc, 40, seed=2)
    assert raced.found == 0 and raced.false_verdict <= 6
    assert race_sim.upper(0, 100) == pytest.approx(1 - 0.05 ** (1 / 100))
    assert race_sim.upper(5, 5) == 1.0


def test_a_design_of_fewer_seeds_and_more_interim_spending_stops_sooner():
    sc = race_sim.Scenario(2, 3.0, noise=1.0, luck=1.0)
    early = race_sim.Design(seeds=5, min_seeds=3, share=1.0)
    late = race_sim.Design(seeds=5, min_seeds=3, share=0.05)
    (r1, g1), (r2, g2) = (race_sim.simulate(sc, 60, seed=3, design=d) for d in (early, late))
    assert g1.runs == g2.runs == 60 * 2 * 5 and r1.false_elim == r2.false_elim == 0
    # the same campaigns: spending more before the last look can only stop them sooner
    assert r1.runs < r2.runs <= g2.runs
    assert "3-5 seeds, interim share 1 |" in race_sim.row(sc, r1, g1, early)


def test_own_scenarios_and_shares_print_a_row_each(capsys):
    assert race_sim.main(["--campaigns", "5", "--seeds", "4", "--interim-share", "0.2,0.6",
                          "--scenario", "2,1,0.5,0.5"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 2 cond")]
    assert [r.split(";")[1].split(" |")[0] for r in rows] == [
        " 3-4 seeds, interim share 0.2", " 3-4 seeds, interim share 0.6"]
