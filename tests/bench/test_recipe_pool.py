"""bench/recipe/pool.py: a candidate's gains paired with the baseline's by (family, seed) over
the races' folders, per family and pooled, from completed runs only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.recipe.pool import completed_gains, main, pair_up, table
from retrain.runfiles import runlog


def _run(folder: Path, family: str, name: str, before: float, after: float,
         status: str = "completed") -> None:
    run = folder / "logs" / family / name
    run.mkdir(parents=True)
    rows = [{"step": 0, "initial_eval_mean_at_k": before, "initial_eval_mean_at_k_se": 0.05,
             "step_time_s": 1.0},
            {"step": 1, "eval_mean_at_k": after, "eval_mean_at_k_se": 0.05, "step_time_s": 1.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runlog.save_state(run, runlog.RunState(status=status, step=1, max_steps=1))


@pytest.fixture
def races(tmp_path) -> list[Path]:
    """Two families: the candidate gains 0.1 more than qv on add2's two seeds and 0.3 more on
    sub1's one; a running seed and a run without its baseline do not count."""
    add2, sub1 = tmp_path / "add2", tmp_path / "sub1"
    for seed, (base, cand) in {1: (0.25, 0.375), 2: (0.5, 0.5625)}.items():
        _run(add2, "add2", f"qv_s{seed}", 0.0, base)
        _run(add2, "add2", f"t1_s{seed}", 0.0, cand)
    _run(add2, "add2", "t1_s3", 0.0, 0.9, status="running")
    _run(add2, "add2", "t1_s4", 0.0, 0.9)                     # no qv_s4: unpaired
    _run(sub1, "sub1", "qv_s1", 0.125, 0.25)
    _run(sub1, "sub1", "t1_s1", 0.125, 0.5)
    return [add2, sub1]


def test_pairs_by_family_and_seed_from_completed_runs(races):
    found = completed_gains(races)
    assert found[("add2", "t1")] == {1: 0.375, 2: 0.5625, 4: 0.9}
    [t1] = pair_up(found, "qv")
    assert t1.keys == (("add2", 1), ("add2", 2), ("sub1", 1))
    assert t1.gains == (0.375, 0.5625, 0.375) and t1.baseline == (0.25, 0.5, 0.125)


def test_the_table_pools_every_pair_and_keeps_each_family(races):
    lines = table(pair_up(completed_gains(races), "qv"), "qv")
    assert lines[0] == "| condition | add2 | sub1 | all pairs | pairs | ahead |"
    # add2: differences 0.125 and 0.0625, mean 0.09375, sd 0.0442, t(0.975, 1) = 12.706:
    # half-width 12.706 x 0.0442 / sqrt 2 = 0.397; sub1 has one pair, so no interval.
    # all three: differences 0.125, 0.0625, 0.25, mean 0.1458, t(0.975, 2) = 4.303, sd 0.0955
    assert lines[2] == ("| `t1` | +9.4 [-30.3, +49.1] | - | +14.6 [-9.1, +38.3] | 3 | 3/3 |")


def test_two_folders_that_disagree_on_a_deterministic_run_are_an_error(races, tmp_path):
    again = tmp_path / "again"
    _run(again, "add2", "qv_s1", 0.0, 0.3)
    with pytest.raises(SystemExit, match="qv seed 1 on add2"):
        completed_gains([*races, again])


def test_a_folder_that_is_not_a_race_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no logs/ folder"):
        main([str(tmp_path)])
