"""The `algorithms` template: six recipes on two-digit additions, each with its paper's usual
values, written by `retrain init`, accepted by `explain`, and every recipe run through the real
CLI (shrunk: the tiny model, 1 step, 1 seed)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from retrain.campaign.race_plan import RacePlan, race_of
from retrain.cli import templates
from retrain.config import loader as config_file
from tests import warm
from tests.run_helpers import DIGITS_REWARD

RECIPES = ["grpo", "dapo", "gspo", "cispo", "dr_grpo", "ppo_2x2"]
# Keys a recipe may change: the algorithm and how a step's samples update the model. A condition
# that changed the task, the model, the sampling or the learning rate would not compare recipes.
ALGORITHM_KEYS = {"algorithm.advantage", "algorithm.loss", "algorithm.loss_aggregation",
                  "algorithm.clip_eps", "algorithm.clip_eps_high", "training.refill",
                  "training.epochs", "training.mini_batches", "reward.overlong_buffer",
                  "reward.overlong_penalty"}


def _plan(tmp_path):
    path = templates.write_template("algorithms", tmp_path / "algorithms.toml")
    cfg, plan = config_file.load(path)
    assert plan is not None
    return cfg, {c.name: c.overrides for c in plan.conditions}, plan


def test_the_recipes_race_on_two_digit_additions(tmp_path):
    cfg, recipes, plan = _plan(tmp_path)
    assert list(recipes) == RECIPES and plan.seeds == list(range(1, 11))
    assert race_of(plan.race) == RacePlan(metric="eval_accuracy", direction="max", min_seeds=3,
                                          round_seeds=1, confidence=0.95, margin=0.03)
    quick = config_file.load_config(templates.write_template("quickstart", tmp_path / "q.toml"))
    # The base is the quickstart with a harder task (its one-digit task is at the ceiling for
    # every recipe): same model, reward, step shape, lr and temperature.
    assert (cfg.data.digits, cfg.data.operations) == (2, ["+"])
    assert cfg.data == replace(quick.data, digits=2, operations=["+"])
    assert (cfg.model, cfg.reward) == (quick.model, quick.reward)
    assert cfg.training == quick.training and cfg.algorithm == quick.algorithm
    for name, overrides in recipes.items():
        assert set(overrides) <= ALGORITHM_KEYS, name


def test_each_recipe_keeps_its_papers_values(tmp_path):
    _, r, _ = _plan(tmp_path)
    # GRPO: today's default, spelled out.
    assert r["grpo"] == {"algorithm.advantage": "grpo", "algorithm.loss": "importance_sampling",
                         "algorithm.loss_aggregation": "token_mean"}
    # DAPO: clip-higher 0.2 / 0.28, token-mean, dynamic sampling, overlong shaping.
    d = r["dapo"]
    assert (d["algorithm.loss"], d["algorithm.clip_eps"], d["algorithm.clip_eps_high"]) == \
        ("ppo", 0.2, 0.28)
    assert d["algorithm.loss_aggregation"] == "token_mean" and d["training.refill"] is True
    assert d["reward.overlong_buffer"] == 10 and d["reward.overlong_penalty"] == 1.0
    # GSPO: the paper's sequence-ratio clip range.
    assert r["gspo"] == {"algorithm.loss": "gspo", "algorithm.clip_eps": 3e-4,
                         "algorithm.clip_eps_high": 4e-4}
    # CISPO: Tinker's bounds, no lower clip and a weight of at most 4.
    assert r["cispo"] == {"algorithm.loss": "cispo", "algorithm.clip_eps": 1.0,
                          "algorithm.clip_eps_high": 3.0}
    # Dr. GRPO: no std division, a constant normaliser.
    assert r["dr_grpo"] == {"algorithm.advantage": "dr_grpo",
                            "algorithm.loss_aggregation": "constant"}
    p = r["ppo_2x2"]
    assert (p["algorithm.loss"], p["training.epochs"], p["training.mini_batches"]) == \
        ("ppo", 2, 2)


def _retrain(cwd: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-m", "retrain", *args], capture_output=True,
                    text=True, env=env, cwd=cwd, timeout=600)


# The template shrunk to the tiny model: 1 step, a race of one decision after 2 seeds, and a
# reward it can earn (the fraction of digits), so every recipe's groups carry signal and its
# update runs.
SHRINK = ["--max-steps", "1", "--set", "campaign.seeds=[1, 2]",
          "--set", "campaign.race.min_seeds=2", "--set", "campaign.max_workers=2",
          "--set", "campaign.stagger_seconds=0", "--set", "model.name=tiny-random",
          "--set", "model.dtype=float32", "--set", "model.threads=1",
          "--set", "data.eval_size=2", "--set", "training.max_tokens=12",
          "--set", "reward.type=custom", "--set", "reward.function=digits.py:reward"]


def test_init_explain_and_every_recipe_runs_through_the_cli(tmp_path, cli_env, tiny_model):
    proc = _retrain(tmp_path, cli_env, "init", "--template", "algorithms")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "algorithms.toml").is_file()
    proc = _retrain(tmp_path, cli_env, "explain", "algorithms.toml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "60 runs (6 conditions x 10 seeds)" in proc.stdout
    assert "decisions after 3, 4, 5, 6, 7, 8, 9, 10 seeds" in proc.stdout
    assert "at least 18 runs, at most 60 of the grid's 60" in proc.stdout
    assert "ppo_2x2_s10" in proc.stdout

    (tmp_path / "digits.py").write_text(DIGITS_REWARD)
    proc = _retrain(tmp_path, cli_env, "algorithms.toml", *SHRINK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    campaign = tmp_path / "logs" / "algorithms"
    for name in RECIPES:
        lines = (campaign / f"{name}_s1" / "metrics.jsonl").read_text().splitlines()
        row = next(r for r in map(json.loads, lines) if r.get("step") == 1)
        assert row["trained_completions"] > 0, name  # the recipe's update ran
        assert row["updates"] == (4 if name == "ppo_2x2" else 1), name
        assert ("prompts_drawn" in row) == (name == "dapo"), name
        assert ("overlong_penalty" in row) == (name == "dapo"), name

    proc = _retrain(tmp_path, cli_env, "compare", "logs/algorithms", "--threshold", "0.3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(name in proc.stdout for name in RECIPES)
    assert "race on eval_accuracy (max, confidence 0.95; decisions after 2 seeds)" in proc.stdout
