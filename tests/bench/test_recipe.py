"""bench/recipe: each family's command is a valid run of the quickstart (or its own config)
with the family's overrides, and the table reports a seed's gain against the noise of its
two evaluations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.recipe.families import FAMILIES
from bench.recipe.measure import command, gain, table, train_share
from retrain.config.loader import load
from retrain.config.overrides import command_line_overrides


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_is_a_valid_run(family, tmp_path):
    argv = command(family, 3, tmp_path, ["training.lr=2e-3"])
    assert argv[:3] == [sys.executable, "-m", "retrain"]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg, plan = load(Path(argv[3]), command_line_overrides(sets, {}))
    assert plan is None and cfg.training.seed == 3 and cfg.training.eval_samples == 4
    assert cfg.training.lr == 2e-3 and cfg.logging.run_name == f"{family}-s3"


def _rows(before: float, after: float, se: float) -> list[dict]:
    return [{"initial_eval_mean_at_k": before, "initial_eval_mean_at_k_se": se,
             "step_time_s": 2.0},
            {"eval_mean_at_k": after, "eval_mean_at_k_se": se, "step_time_s": 4.0}]


def test_a_seed_learns_only_beyond_twice_the_noise_of_the_difference():
    assert gain(_rows(0.1, 0.4, 0.05))["learns"]           # +0.30 > 2 x 0.071
    assert not gain(_rows(0.1, 0.2, 0.05))["learns"]       # +0.10 < 2 x 0.071
    runs = [gain(_rows(0.1, 0.1 + g, 0.01)) for g in (0.3, 0.4, 0.5)]
    text = table({"add2": runs})
    assert "| add2 | 3 | 0.100 | 0.500 | +40.0 pts | +15.2 pts | 3/3 |" in text


def test_the_training_share_counts_only_the_steps_that_trained():
    rows = [{"step": 1, "updates": 1, "step_time_s": 4.0, "train_time_s": 1.0},
            {"step": 2, "updates": 0, "step_time_s": 3.0, "train_time_s": 0.0},
            {"step": 3, "updates": 2, "step_time_s": 6.0, "train_time_s": 3.0}]
    assert train_share(rows) == 0.4                    # (1 + 3) / (4 + 6)
    assert train_share(rows[1:2]) is None
