"""A raced campaign on the tiny model through the real CLI: three recipes learning the digits
reward, one with a learning rate far too small to learn (1e-7, the nearest to lr = 0 that
training.lr allows). explain prints the race's plan; the first round (3 seeds each) eliminates
the tiny learning rate; the runner is SIGKILLed while the second round (seed 4) trains, after the
first decision is in the manifest; the rerun adopts the live workers and finishes the same race
with no run started twice; status and compare show the decisions with their intervals.

Why the two that learn stay in the race: grpo and rloo at lr 5e-2 both end above 0.9 on every
seed (tests/campaign/test_campaign_e2e.py), so their per-seed differences are a few points
either way, far inside the first decision's 99.75% interval at 3 seeds."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from bench.campaign.tiny import tiny_campaign_toml
from retrain.campaign.manifest import load_manifest
from retrain.runfiles import runlog
from tests import warm
from tests.run_helpers import DIGITS_REWARD

STEPS = 30
TABLES = """
[reward]
type = "custom"
function = "digits.py:reward"
[[campaign.conditions]]
name = "grpo"
[[campaign.conditions]]
name = "rloo"
"algorithm.advantage" = "rloo"
[[campaign.conditions]]
name = "tiny-lr"
"training.lr" = 1e-7
[campaign.race]
min_seeds = 3
max_seeds = 4
"""


def _retrain(env: dict, *args: str, timeout: float = 600):
    return warm.run([sys.executable, "-m", "retrain", *args], env=env, text=True,
                    capture_output=True, timeout=timeout)


def _decided_and_round_two_training(camp: Path) -> bool:
    """Decision 1 is in the manifest and a seed-4 run has trained a step."""
    m = load_manifest(camp) if (camp / runlog.MANIFEST_FILE).exists() else None
    if m is None or not m.race.get("state", {}).get("looks"):
        return False
    state = [runlog.load_state(camp / r.name) for r in m.runs if r.seed == 4]
    return any(s is not None and s.status == "running" and s.step >= 1 for s in state)


def test_a_raced_campaign_eliminates_the_tiny_lr_and_survives_a_killed_runner(tmp_path, cli_env,
                                                                              tiny_model):
    pytest.importorskip("scipy")
    (tmp_path / "digits.py").write_text(DIGITS_REWARD)
    text = tiny_campaign_toml(tmp_path / "logs", "[1, 2, 3, 4]", max_steps=STEPS,
                              max_workers=2, tables=TABLES,
                              training="lr = 5e-2\nsave_every = 10")
    path = tmp_path / "race.toml"
    path.write_text(text.replace("batch_size = 2\ngroup_size = 2",
                                 "batch_size = 4\ngroup_size = 8"))
    plan = _retrain(cli_env, "explain", str(path))
    assert plan.returncode == 0, plan.stderr
    assert "decisions after 3, 4 seeds (rounds of 1;" in plan.stdout
    assert "at least 9 runs, at most 12 of the grid's 12" in plan.stdout

    runner = warm.Popen([sys.executable, "-m", "retrain", "run", str(path)], env=cli_env,
                        text=True, stdout=warm.subprocess.PIPE,
                        stderr=warm.subprocess.STDOUT)
    camp = tmp_path / "logs" / "race"
    deadline = time.monotonic() + 600
    while not _decided_and_round_two_training(camp):
        assert time.monotonic() < deadline and runner.poll() is None, runner.communicate()[0]
        time.sleep(0.1)
    first = load_manifest(camp).race["state"]["looks"][0]
    assert first["eliminated"] == ["tiny-lr"] and first["seeds"] == [1, 2, 3]
    os.kill(runner.pid, signal.SIGKILL)
    killed_output, _ = runner.communicate(timeout=60)
    assert "race: tiny-lr: eliminated after 3 seeds" in killed_output

    done = _retrain(cli_env, "run", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "still running from a previous runner" in done.stdout
    m = load_manifest(camp)
    assert m.status == "completed" and m.race["state"]["looks"][0] == first
    assert len(m.race["state"]["looks"]) == 2 and m.race["runs"]["taken"] == 11
    assert {r.name: r.status for r in m.runs if r.status != "completed"} == {
        "tiny-lr_s4": "skipped"}
    started_before = re.findall(r"\] start (\S+)", killed_output)
    started = started_before + re.findall(r"\] start (\S+)", done.stdout)
    assert len(started) == len(set(started)) == 11  # every run the race needed, each once
    for r in m.runs:
        if r.status == "completed":
            rows = runlog.read_metrics(camp / r.name / "metrics.jsonl").rows
            assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), r.name
            # a worker started before the kill is adopted, not started again; only a run the
            # kill caught between its launch trace and its start becomes attempt 2
            assert r.attempts == 1 or r.name not in started_before, r.name

    status = _retrain(cli_env, "status", str(tmp_path / "logs"))
    assert "race on final_reward (max, confidence 0.95; decisions after 3, 4 seeds)" \
        in status.stdout
    assert "tiny-lr: eliminated after 3 seeds (final_reward tiny-lr - " in status.stdout
    compare = _retrain(cli_env, "compare", str(camp), "--json")
    report = json.loads(compare.stdout)
    assert report["race"]["state"]["standings"]["tiny-lr"]["state"] == "eliminated"
    why = report["race"]["state"]["standings"]["tiny-lr"]["why"]
    assert why["hi"] < 0 and why["seeds"] == [1, 2, 3]
    tiny = next(c for c in report["conditions"] if c["name"] == "tiny-lr")
    assert tiny["completed"] == 3 and tiny["vs_baseline"][0]["test"] == "paired t"
