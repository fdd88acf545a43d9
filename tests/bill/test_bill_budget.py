"""Budgets that stop spending (issue 55), through the real CLI on the tiny model: a single run
stops at the step where its [training] budget is reached and continues when it is raised; a
campaign starts no run whose bound would cross its [campaign] budget, hands its runs the rest
so a running run stops at the crossing, and resumes when the budget is raised.

Prices are per sampled token, so the crossing step is a count, not a moment: with eval_size
0, batch 2 x group 4 and 8-token replies (every reply of the seeded tiny model hits
max_tokens, checked) a step samples 64 tokens, $0.064 at sample_per_mtok = 1000."""

from __future__ import annotations

import json
import sys

import pytest

from retrain.campaign.manifest import load_manifest
from retrain.config import toml_io
from tests import warm
from tests.run_helpers import rows, state, write_config

pytest.importorskip("torch")

STEP_USD = 64 * 1000 / 1_000_000


def _retrain(env: dict, cwd, *args) -> object:
    return warm.run([sys.executable, "-m", "retrain", *map(str, args)], env=env, text=True,
                    capture_output=True, timeout=600, cwd=cwd)


def _config(tmp_path, name: str, **extra) -> object:
    path = write_config(tmp_path, name, data={"source": "arithmetic", "eval_size": 0},
                        cost={"sample_per_mtok": 1000.0}, **extra)
    return path


def _set(path, section: str, **keys) -> None:
    raw = toml_io.loads(path.read_text())
    raw.setdefault(section, {}).update(keys)
    path.write_text(toml_io.dumps(raw))


def test_a_run_stops_at_its_budget_and_continues_when_it_is_raised(tmp_path, cli_env):
    path = _config(tmp_path, "run", training={"max_steps": 4, "budget_usd": 2.5 * STEP_USD})
    done = _retrain(cli_env, tmp_path, path)
    run_dir = tmp_path / "logs" / "run"
    assert done.returncode == 3, done.stdout + done.stderr
    got = rows(run_dir)
    assert all(r["sampled_tokens"] == 64 for r in got)  # the hand count the budget relies on
    assert [r["step"] for r in got] == [1, 2, 3]  # $0.192 >= $0.16 after step 3
    assert "stopped after step 3/4: spent $0.1920, reaching training.budget_usd = $0.1600" \
        in done.stderr and "Traceback" not in done.stderr
    st = state(run_dir)
    assert st["status"] == "budget" and st["step"] == 3 and "budget_usd" in st["error"]
    again = _retrain(cli_env, tmp_path, path)  # the same budget: no further step
    assert again.returncode == 3 and [r["step"] for r in rows(run_dir)] == [1, 2, 3]
    _set(path, "training", budget_usd=1.0)
    more = _retrain(cli_env, tmp_path, path)
    assert more.returncode == 0, more.stdout + more.stderr
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4]
    assert state(run_dir)["status"] == "completed"


def test_a_campaign_starts_only_the_runs_whose_bound_fits(tmp_path, cli_env, tiny_model):
    """A run's bound here is its spend exactly (eval_size 0, only sampled tokens priced,
    every reply max_tokens long): 4 steps x $0.064. $0.40 fits one run, not two. (tiny_model:
    the model is on this machine before the runner bounds its runs' prompts.)"""
    path = _config(tmp_path, "camp", training={"max_steps": 4})
    _set(path, "campaign", seeds=[1, 2], stagger_seconds=0.0, budget_usd=0.4)
    done = _retrain(cli_env, tmp_path, path)
    assert done.returncode == 3, done.stdout + done.stderr
    camp = tmp_path / "logs" / "camp"
    by_name = {r.name: r for r in load_manifest(camp).runs}
    names = sorted(by_name)
    assert [by_name[n].status for n in names] == ["completed", "budget"]
    assert [r["step"] for r in rows(camp / names[0])] == [1, 2, 3, 4]
    assert by_name[names[0]].spent["sampled"] == 4 * 64
    assert not (camp / names[1] / "metrics.jsonl").exists()  # never started
    assert (f"{names[1]}: not started: its bound of $0.2560 more after $0.2560 spent would "
            "cross campaign.budget_usd = $0.4000") in done.stdout
    _set(path, "campaign", budget_usd=1.0)  # raised: the second runs
    more = _retrain(cli_env, tmp_path, path)
    assert more.returncode == 0, more.stdout + more.stderr
    assert [r["step"] for r in rows(camp / names[1])] == [1, 2, 3, 4]
    manifest = load_manifest(camp)
    assert {r.status for r in manifest.runs} == {"completed"}
    assert json.loads((camp / "manifest.json").read_text())["status"] == "completed"


def test_a_running_run_stops_where_the_campaign_crosses(tmp_path, cli_env):
    """Device-hours have no bound before a run, so a run priced by them starts; the rest of
    the campaign's budget it is handed stops it at the row where the campaign crosses, and
    the next run is not started."""
    path = _config(tmp_path, "camp", training={"max_steps": 40})
    _set(path, "cost", sample_per_mtok="none", device_hour=3600.0)  # $1 a wall second
    _set(path, "campaign", seeds=[1, 2], stagger_seconds=0.0, budget_usd=0.2)
    done = _retrain(cli_env, tmp_path, path)
    assert done.returncode == 3, done.stdout + done.stderr
    camp = tmp_path / "logs" / "camp"
    by_name = {r.name: r for r in load_manifest(camp).runs}
    names = sorted(by_name)
    assert [by_name[n].status for n in names] == ["budget", "budget"]
    got = rows(camp / names[0])
    walls = [r["wall_s"] for r in got]
    assert sum(walls[:-1]) < 0.2 <= sum(walls) and len(got) < 40  # stopped at the crossing
    assert state(camp / names[0])["status"] == "budget"
    assert not (camp / names[1] / "metrics.jsonl").exists()
    assert f"{names[1]}: not started: spent $" in done.stdout
