"""bench/recipe/race.py, the command that races candidate defaults on a task family (an hour of
CPU a family: the lead runs it alone), run here on the tiny model through the real CLI: the
campaign holds the family's run, its mean@4 eval and the candidates as conditions; the table
pairs each condition's gains with the baseline's by seed; a second call resumes."""

from __future__ import annotations

import pytest

from bench.campaign import algorithms_race
from bench.recipe import race
from tests import warm


def test_a_condition_joins_candidates_and_scales_the_family_lr():
    base = {"training": {"lr": 5e-4}}
    table = race.condition("all_linear+lr_double", base)
    assert table["name"] == "all_linear_and_lr_double"
    assert table["training.lr"] == pytest.approx(1e-3)
    assert table["model.lora_target_modules"] == ["all-linear"]
    with pytest.raises(SystemExit, match="no candidate 'rank7'"):
        race.condition("qv+rank7", base)


def test_clip_higher_joined_to_ppo_2x2_has_the_upper_clip_and_the_updates_that_move_it():
    table = race.condition("ppo_2x2+clip_higher", {"training": {"lr": 1e-3}})
    assert table["algorithm.clip_eps_high"] == 0.28 and table["algorithm.clip_eps"] == 0.2
    assert (table["training.epochs"], table["training.mini_batches"]) == (2, 2)
    assert race.condition("ppo_2x2", {})["algorithm.clip_eps_high"] == 0.2
    one_pass = race.condition("ppo_1x2", {})
    assert "training.epochs" not in one_pass and one_pass["training.mini_batches"] == 2


def test_the_bench_races_candidates_and_writes_its_table(tmp_path, cli_env, tiny_model,
                                                         monkeypatch):
    pytest.importorskip("scipy")
    monkeypatch.setattr(algorithms_race, "RUN", lambda *a, **kw: warm.run(*a, env=cli_env, **kw))
    out = tmp_path / "race"
    args = ["--family", "sub1", "--conditions", "qv,t1", "--seeds", "1,2",
            "--min-seeds", "2", "--out", str(out), "--tiny"]
    assert race.main(args) == 0
    text = (out / "race_table.md").read_text()
    lines = text.splitlines()
    assert lines[0].startswith("| condition | race | seeds | gain of mean@4 per seed (pts) |")
    assert "paired vs qv [95%]" in lines[0] and lines[0].endswith("| training's share |")
    for row in lines[2:4]:   # '-' where no step trained (the tiny model may earn no reward)
        share = row.split(" | ")[9].rstrip(" |")
        assert share == "-" or 0 < float(share) < 1
    assert [ln.split(" | ")[0] for ln in lines[2:4]] == ["| `qv`", "| `t1`"]
    assert lines[2].split(" | ")[7] == "-" and "[" in lines[3].split(" | ")[7]
    assert "runs: 4 of the full grid's 4 (0 saved)" in text
    assert "race on eval_mean_at_k (max, confidence 0.95; decisions after 2 seeds)" in text
    campaign = (out / "sub1.toml").read_text()
    # the temperature candidate trains at 1.0 and is scored at the family's 0.7, as qv is
    assert "eval_temperature = 0.7" in campaign and '"training.temperature" = 1.0' in campaign
    assert 'operations = ["-"]' in campaign and "eval_samples = 4" in campaign
    assert race.main(args) == 0 and (out / "race_table.md").read_text() == text


def test_a_family_without_a_temperature_is_scored_at_the_default_one(tmp_path):
    path = race.write_campaign(tmp_path, "rg", ["qv", "t1"], [1, 2, 3], 3, 1, tiny=True)
    text = path.read_text()
    assert "eval_temperature = 1.0" in text and 'kind = "reasoning_gym"' in text
