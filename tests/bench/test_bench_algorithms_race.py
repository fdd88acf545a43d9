"""bench/campaign/algorithms_race.py, the command that races the algorithms template on SmolLM2
(hours: the lead runs it alone), run here on the tiny model: it writes the campaign with its
overrides baked in, races it through the real CLI, and writes the decided table; a second call
resumes."""

from __future__ import annotations

import pytest

from bench.campaign import algorithms_race
from tests import warm


def test_the_bench_races_the_template_and_writes_its_table(tmp_path, cli_env, tiny_model,
                                                            monkeypatch):
    pytest.importorskip("scipy")
    monkeypatch.setattr(algorithms_race, "RUN", lambda *a, **kw: warm.run(*a, env=cli_env, **kw))
    out = tmp_path / "race"
    assert algorithms_race.main(["--out", str(out), "--tiny", "--conditions", "grpo,dr_grpo",
                                 "--set", "campaign.race.margin=0.5"]) == 0
    text = (out / "race_table.md").read_text()
    lines = text.splitlines()
    assert lines[0].startswith("| recipe | race | seeds | held-out before |")
    assert [ln.split(" | ")[0] for ln in lines[2:4]] == ["| `grpo`", "| `dr_grpo`"]
    assert "runs: 4 of the full grid's 4 (0 saved)" in text
    assert "race on eval_accuracy (max, confidence 0.95; decisions after 2 seeds)" in text
    campaign = (out / "algorithms.toml").read_text()
    assert 'name = "tiny-random"' in campaign and "margin = 0.5" in campaign
    assert 'name = "ppo_2x2"' not in campaign
    again = algorithms_race.main(["--out", str(out), "--tiny"])  # resumes: nothing to run
    assert again == 0 and (out / "race_table.md").read_text() == text
