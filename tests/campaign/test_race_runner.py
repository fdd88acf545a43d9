"""A raced campaign through the real runner, with a fake worker whose reward is set per condition
and seed (`backend.options.rewards`): rounds launch in order, a clear loser is eliminated at the
first decision, runs the race does not need are skipped, the race's state is in the manifest
before the next round starts, and a SIGKILLed runner's successor finishes the same race with no
run started twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from retrain.campaign import executor as ex
from retrain.campaign.manifest import load_manifest
from retrain.campaign.runner import run_campaign
from retrain.config.loader import load
from retrain.config.sections import ConfigError
from retrain.errors import UserError

pytest.importorskip("scipy")

REPO = Path(__file__).resolve().parents[2]

FAKE_WORKER = textwrap.dedent('''
    """Writes `training.max_steps` rows of mean_reward = rewards[seed - 1], like a trainer."""
    import json, os, signal, sys, time, tomllib
    from pathlib import Path
    from retrain.runfiles import runlog

    cfg = tomllib.loads(Path(sys.argv[1]).read_text())
    opts, seed = cfg["backend"]["options"], cfg["training"]["seed"]
    run_dir = Path(cfg["logging"]["log_dir"]) / cfg["logging"]["run_name"]
    with open(os.environ["FAKE_EVENTS"], "a") as fh:
        fh.write(json.dumps({"tag": "start", "run": cfg["logging"]["run_name"],
                             "t": time.time()}) + "\\n")
    state = runlog.load_state(run_dir) or runlog.RunState()
    state.status, state.pid, state.max_steps = "running", os.getpid(), cfg["training"]["max_steps"]
    runlog.save_state(run_dir, state)
    if opts["rewards"][seed - 1] == "fail":
        sys.exit(3)  # a run that fails, on every attempt
    step_s = opts["slow_step_s"] if seed >= opts.get("slow_from_seed", 99) else 0.01
    with runlog.MetricsWriter(run_dir / runlog.METRICS_FILE) as metrics:
        for step in range(state.step + 1, state.max_steps + 1):
            time.sleep(step_s)
            metrics.write({"step": step, "mean_reward": opts["rewards"][seed - 1],
                           "step_time_s": step_s, "sampled_tokens": 100})
            state.step = step
            runlog.save_state(run_dir, state)
    state.status = "completed"
    runlog.save_state(run_dir, state)
''')

DRIVER = textwrap.dedent('''
    import sys
    from retrain.campaign.executor import LocalExecutor
    from retrain.campaign.runner import run_campaign
    from retrain.config.loader import load
    path, fake = sys.argv[1], sys.argv[2]
    sys.exit(run_campaign(*load(path), path, executor=LocalExecutor([sys.executable, fake])))
''')

TOML = """
[training]
max_steps = 2
[backend.options]
slow_from_seed = {slow_from_seed}
slow_step_s = 0.4
[logging]
log_dir = "{log_dir}"
[campaign]
seeds = [1, 2, 3, 4, 5]
parallel = true
max_workers = 3
stagger_seconds = 0
[[campaign.conditions]]
name = "good"
"backend.options.rewards" = [0.91, 0.88, 0.93, 0.90, 0.92]
[[campaign.conditions]]
name = "close"
"backend.options.rewards" = [0.90, 0.89, 0.90, 0.91, 0.89]
[[campaign.conditions]]
name = "bad"
"backend.options.rewards" = [0.05, 0.03, 0.06, 0.04, 0.05]
[campaign.race]
min_seeds = 3
{race}
"""


@pytest.fixture
def env(tmp_path, monkeypatch):
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    (tmp_path / "driver.py").write_text(DRIVER)
    monkeypatch.setenv("FAKE_EVENTS", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return tmp_path


def _write(tmp: Path, race: str = "", slow_from_seed: int = 99) -> Path:
    path = tmp / "exp.toml"
    path.write_text(TOML.format(log_dir=tmp / "logs", race=race, slow_from_seed=slow_from_seed))
    return path


def _run(tmp: Path, path: Path, **kw) -> int:
    executor = ex.LocalExecutor([sys.executable, str(tmp / "fake_worker.py")])
    return run_campaign(*load(path), path, executor=executor, **kw)


def _starts(tmp: Path) -> list[dict]:
    lines = (tmp / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["tag"] == "start"]


def test_rounds_eliminate_the_loser_and_skip_what_the_race_does_not_need(env, capsys):
    path = _write(env)
    assert _run(env, path) == 0
    m = load_manifest(env / "logs" / "exp")
    status = {r.name: r.status for r in m.runs}
    assert status == {**{f"{c}_s{s}": "completed" for c in ("good", "close") for s in range(1, 6)},
                      **{f"bad_s{s}": "completed" for s in (1, 2, 3)},
                      "bad_s4": "skipped", "bad_s5": "skipped"}
    assert m.status == "completed"
    race = m.race
    assert race["outcome"] == "max_seeds" and race["runs"] == {"taken": 13, "saved": 2,
                                                               "full": 15}
    looks = race["state"]["looks"]
    assert [(x["number"], x["seeds"], x["eliminated"]) for x in looks] == [
        (1, [1, 2, 3], ["bad"]), (2, [1, 2, 3, 4], []), (3, [1, 2, 3, 4, 5], [])]
    assert looks[0]["values"]["bad"] == {"1": 0.05, "2": 0.03, "3": 0.06}
    standings = race["state"]["standings"]
    assert {c: (s["state"], s["look"], s["seeds"]) for c, s in standings.items()} == {
        "good": ("undecided", 3, 5), "close": ("undecided", 3, 5), "bad": ("eliminated", 1, 3)}
    bad = standings["bad"]["why"]
    assert bad["other"] in ("good", "close") and bad["hi"] < 0 and bad["seeds"] == [1, 2, 3]
    # Rounds: every run of seeds 1-3 ended before a run of seed 4 started, and so on.
    ended = {r.name: r.ended_at for r in m.runs}
    started = {r.name: r.started_at for r in m.runs}
    for seed in (4, 5):
        later = [started[n] for n in started if n.endswith(f"_s{seed}") and started[n]]
        earlier = [ended[n] for n in ended if int(n.rsplit("_s", 1)[1]) < seed and ended[n]]
        assert min(later) >= max(earlier)
    out = capsys.readouterr().out
    assert "race: decision 1 after 3 seeds" in out and "race: bad: eliminated after 3 seeds" \
        in out and "race: max_seeds; 13 of 15 runs (2 saved so far)" in out
    assert len(_starts(env)) == 13
    assert _run(env, path) == 0  # again: nothing to run, the race is over
    assert len(_starts(env)) == 13


def test_a_winner_ends_the_race_and_a_budget_stops_it(env):
    path = _write(env, race="budget_runs = 11")
    assert _run(env, path) == 0
    m = load_manifest(env / "logs" / "exp")
    assert m.race["outcome"] == "budget" and m.race["runs"]["taken"] == 11
    assert sum(r.status == "completed" for r in m.runs) == 11
    win = env / "win.toml"
    win.write_text(_write(env).read_text().replace('name = "close"', 'name = "poor"').replace(
        "[0.90, 0.89, 0.90, 0.91, 0.89]", "[0.10, 0.12, 0.09, 0.11, 0.10]"))
    assert _run(env, win) == 0
    m = load_manifest(env / "logs" / "win")
    assert m.race["outcome"] == "winner" and m.race["runs"]["taken"] == 9
    assert m.race["state"]["standings"]["good"]["state"] == "winner"
    assert sum(r.status == "skipped" for r in m.runs) == 6


def test_a_sigkilled_runner_resumes_the_same_race_and_runs_nothing_twice(env):
    """Killed while round 2 (seed 4) runs, after decision 1 is in the manifest: the next
    runner adopts the live workers and finishes the race with the same decisions."""
    path = _write(env, slow_from_seed=4)
    runner = subprocess.Popen([sys.executable, str(env / "driver.py"), str(path),
                               str(env / "fake_worker.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    camp = env / "logs" / "exp"
    deadline = time.monotonic() + 60
    while True:  # a state to assert on: decision 1 recorded and a seed-4 worker started
        m = load_manifest(camp) if (camp / "manifest.json").exists() else None
        decided = m is not None and m.race.get("state", {}).get("looks")
        # pid 0 is the trace saved just before a launch: its worker may never have started
        started = [r.name for r in m.runs if r.seed == 4 and r.status == "running"
                   and r.pid] if decided else []
        if started:
            break
        assert time.monotonic() < deadline and runner.poll() is None, runner.stdout.read()
        time.sleep(0.02)
    first = m.race["state"]["looks"][0]
    assert first["eliminated"] == ["bad"]
    os.kill(runner.pid, signal.SIGKILL)
    runner.communicate(timeout=30)
    assert _run(env, path) == 0
    m = load_manifest(camp)
    assert m.race["state"]["looks"][0] == first and m.race["outcome"] == "max_seeds"
    # the workers seen started were adopted (or had finished), not started again; a run the
    # kill caught between its launch trace and its start is started once, as attempt 2
    assert all(m.entry(name).attempts == 1 for name in started)
    names = [e["run"] for e in _starts(env)]
    assert len(names) == len(set(names)) == 13  # every run the race needed, each once


def test_a_race_whose_plan_changed_after_a_decision_is_refused_unless_forced(env):
    path = _write(env)
    assert _run(env, path) == 0
    path.write_text(path.read_text().replace("min_seeds = 3", "min_seeds = 3\nconfidence = 0.9"))
    with pytest.raises(UserError, match=r"\[campaign.race\] changed since the race's first "
                                        r"decision \(3 made\).*--new.*--force"):
        _run(env, path)
    assert _run(env, path, force=True) == 0  # decided afresh from the runs on disk
    m = load_manifest(env / "logs" / "exp")
    assert m.race["plan"]["confidence"] == 0.9 and len(_starts(env)) == 13


def test_a_metric_the_runs_do_not_produce_is_refused_in_one_line_before_anything_runs(env):
    path = _write(env, race='metric = "eval_accuracy"')
    path.write_text(path.read_text() + "[data]\neval_size = 0\n")
    with pytest.raises(ConfigError) as info:
        _run(env, path)
    text = str(info.value)
    assert len(text.splitlines()) == 1 and "campaign.race.metric" in text
    assert "condition 'good' has data.eval_size = 0" in text
    assert not (env / "events.jsonl").exists() and not (env / "logs").exists()


def test_status_compare_and_explain_show_the_race(env, capsys):
    from retrain.cli.app import run_app

    path = _write(env)
    assert run_app(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("race           final_reward (max) at confidence 0.95: decisions after 3, 4, 5 "
            "seeds (rounds of 1; each pair's interval at 98.6% to 99.9333%); at least 9 "
            "runs, at most 15 of the grid's 15") in out
    assert _run(env, path) == 0
    capsys.readouterr()
    camp = env / "logs" / "exp"
    assert run_app(["status", str(env / "logs")]) == 0
    out = capsys.readouterr().out
    assert ("race on final_reward (max, confidence 0.95; decisions after 3, 4, 5 seeds): "
            "max_seeds (5) reached without a verdict") in out
    assert "bad: eliminated after 3 seeds (final_reward bad - " in out
    assert "good: undecided after 5 seeds" in out and "runs: 13 of the grid's 15" in out
    assert "skipped 0/2" in out  # bad_s4, bad_s5 in the matrix
    assert run_app(["compare", str(camp)]) == 0
    out = capsys.readouterr().out
    assert "the race's decisions (manifest.json), each with the interval that made it:" in out
    assert "not run, the race did not need them: bad_s4, bad_s5" in out
    assert "excluded from the means" not in out
    assert ("bad vs good: final reward -0.86 [-0.885, -0.835] (paired t, seeds 1, 2, 3; seeds "
            "4, 5 unpaired, left out): bad is lower than good") in out
    assert run_app(["compare", str(camp), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["race"]["outcome"] == "max_seeds" and data["excluded"] == []
    manifest = json.loads((camp / "manifest.json").read_text())
    manifest["race"]["state"] = {"looks": "garbage"}
    (camp / "manifest.json").write_text(json.dumps(manifest))
    assert run_app(["status", str(env / "logs")]) == 0
    assert f"race: {camp / 'manifest.json'}'s race is unreadable (race.state.conditions: " \
        "missing)" in capsys.readouterr().out.replace("\n  ", " ")


def test_a_hand_broken_race_in_the_manifest_is_one_line_not_a_traceback(env):
    path = _write(env)
    assert _run(env, path) == 0
    manifest = env / "logs" / "exp" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["race"]["state"]["looks"] = [{"number": "x"}]
    manifest.write_text(json.dumps(data))
    with pytest.raises(UserError, match="manifest.json's race cannot be read .*--new"):
        _run(env, path)


def test_a_finished_race_with_its_seeds_reordered_is_refused_naming_both_orders(env):
    """A race takes seeds in order: reordered, its decisions no longer hold, and deciding afresh
    (which the runner would otherwise do silently) needs --force."""
    path = _write(env)
    bad = '[[campaign.conditions]]\nname = "bad"\n"backend.options.rewards" = [0.05, 0.03, 0.06, ' \
          '0.04, 0.05]\n'
    assert bad in path.read_text()
    path.write_text(path.read_text().replace(bad, ""))  # every run runs: every config.toml
    assert _run(env, path) == 0
    decided = load_manifest(env / "logs" / "exp").race
    assert decided["outcome"] == "max_seeds" and decided["runs"]["saved"] == 0
    path.write_text(path.read_text().replace("seeds = [1, 2, 3, 4, 5]", "seeds = [4, 5, 1, 2, 3]"))
    with pytest.raises(UserError) as info:
        _run(env, path)
    text = str(info.value)
    assert len(text.splitlines()) == 1 and "hash" not in text, text
    assert "the race's seeds 1, 2, 3, 4, 5 -> 4, 5, 1, 2, 3 since the race's first decision " \
           "(3 made)" in text and "--new" in text and "--force" in text
    assert load_manifest(env / "logs" / "exp").race == decided  # untouched
    assert _run(env, path, force=True) == 0  # decided afresh, in the new order
    looks = load_manifest(env / "logs" / "exp").race["state"]["looks"]
    assert looks[0]["seeds"] == [4, 5, 1] and len(_starts(env)) == 10  # no run twice


@pytest.mark.parametrize("where, value, field", [
    (("state", "standings", "bad", "why", "diff"), "-0.86", "race.state.standings.bad.why.diff: "
                                                          'expected a number, got "-0.86"'),
    (("state", "standings", "good", "seeds"), "5", "race.state.standings.good.seeds: expected an "
                                                   'integer, got "5"'),
    (("state", "looks", 0, "values", "bad", "1"), "0.05", "race.state.looks[0].values.bad.1: "
                                                          'expected a number, got "0.05"'),
    (("plan", "confidence"), "0.95", 'race.plan.confidence: expected a number, got "0.95"'),
    (("runs", "saved"), "2", 'race.runs.saved: expected an integer, got "2"'),
])
def test_a_string_for_a_number_in_the_race_is_one_line_naming_file_and_field(
        race_done, tmp_path, capsys, where, value, field):
    """A hand edit of manifest.json's race: status and compare say which field, in one line,
    and show the rest (the runs, compare's own table) as usual."""
    import shutil

    from retrain.cli.app import run_app

    shutil.copytree(race_done / "logs", tmp_path / "logs")
    camp = tmp_path / "logs" / "exp"
    manifest = camp / "manifest.json"
    data = json.loads(manifest.read_text())
    inner = data["race"]
    for key in where[:-1]:
        inner = inner[key]
    inner[where[-1]] = value
    manifest.write_text(json.dumps(data))
    line = f"race: {manifest}'s race is unreadable ({field})"
    for args in (["status", str(tmp_path / "logs")], ["compare", str(camp)]):
        assert run_app(args) == 0
        out = capsys.readouterr().out.replace("\n  ", " ")  # the renderer wraps long lines
        assert line in out and "Traceback" not in out, out
        assert "good" in out and "close" in out  # the runs still show


@pytest.fixture(scope="module")
def race_done(tmp_path_factory):
    """A finished race (the default file), for tests to copy and edit."""
    base = tmp_path_factory.mktemp("race-done")
    (base / "fake_worker.py").write_text(FAKE_WORKER)
    mp = pytest.MonkeyPatch()
    mp.setenv("FAKE_EVENTS", str(base / "events.jsonl"))
    mp.setenv("PYTHONPATH", str(REPO))
    try:
        assert _run(base, _write(base)) == 0
    finally:
        mp.undo()
    return base


def test_a_condition_whose_runs_all_fail_stops_after_max_retries_and_says_so(env, capsys):
    from retrain.cli.app import run_app

    path = _write(env)
    path.write_text(path.read_text().replace("[0.05, 0.03, 0.06, 0.04, 0.05]",
                                             '["fail", "fail", "fail", "fail", "fail"]'))
    assert _run(env, path) != 0  # bad's runs failed: the race waits for their retry
    assert "race: waits for bad_s1, bad_s2, bad_s3" in capsys.readouterr().out
    assert _run(env, path) != 0  # retried (max_retries = 1) and failed for good
    out = capsys.readouterr().out
    assert "race: bad: no figures at decision 1 (every run of it failed or has no " \
           "final_reward); it takes no more seeds" in out
    m = load_manifest(env / "logs" / "exp")
    assert {r.name: r.status for r in m.runs if r.condition == "bad"} == {
        "bad_s1": "failed", "bad_s2": "failed", "bad_s3": "failed", "bad_s4": "skipped",
        "bad_s5": "skipped"}
    assert m.race["state"]["standings"]["bad"]["state"] == "no_figures"
    started = [e["run"] for e in _starts(env)]
    assert sorted(n for n in started if n.startswith("bad")) == [
        "bad_s1", "bad_s1", "bad_s2", "bad_s2", "bad_s3", "bad_s3"]  # 2 attempts, no seed 4
    assert run_app(["status", str(env / "logs")]) in (0, 1)
    assert "bad: no figures at decision 1" in capsys.readouterr().out.replace("\n  ", " ")


def test_a_token_budget_stops_a_race_between_its_runs(env, capsys):
    """[campaign] budget_tokens beside a race: each run spends 200 tokens (2 rows of 100
    sampled); 1,000 pay for 5 runs, so the first round (9 runs) cannot finish. The runner starts
    no run past the budget, ends with the budget's exit status and no verdict, and a raised
    budget lets the same race go on from where it stopped."""
    path = _write(env)
    # one worker at a time: runs running at once each see the spend before theirs (docs/cost.md)
    path.write_text(path.read_text().replace("stagger_seconds = 0", "stagger_seconds = 0\n"
                                             "budget_tokens = 1000").replace(
        "max_workers = 3", "max_workers = 1"))
    done = subprocess.run([sys.executable, str(env / "driver.py"), str(path),
                           str(env / "fake_worker.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    m = load_manifest(env / "logs" / "exp")
    assert sum(r.status == "completed" for r in m.runs) == 5
    assert {r.status for r in m.runs} <= {"completed", "budget", "pending"}
    assert not m.race.get("state", {}).get("looks")  # no decision on a round cut short
    assert len(_starts(env)) == 5
    path.write_text(path.read_text().replace("budget_tokens = 1000", "budget_tokens = 100000"))
    assert _run(env, path) == 0
    m = load_manifest(env / "logs" / "exp")
    assert m.race["outcome"] == "max_seeds" and m.race["runs"]["taken"] == 13
    assert len(_starts(env)) == 13  # the 5 done before were not run again
