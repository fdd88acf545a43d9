"""`retrain status` on synthetic logs: every run state, torn lines, a failed run, campaigns."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types
from io import StringIO

import pytest

from retrain.cli import status, status_view
from retrain.cli.app import run_app
from retrain.runfiles import runlog

HOST = socket.gethostname()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make_run(folder, state=None, rows=(), tail=b"", config_steps=None):
    folder.mkdir(parents=True, exist_ok=True)
    if state is not None:
        runlog.write_json_atomic(folder / "state.json", state)
    if rows or tail:
        body = b"".join(json.dumps(r).encode() + b"\n" for r in rows) + tail
        (folder / "metrics.jsonl").write_bytes(body)
    if config_steps is not None:
        (folder / "config.toml").write_text(f"[training]\nmax_steps = {config_steps}\n")
    return folder


def rows(n, **extra):
    return [{"step": i, "mean_reward": i / 10, "step_time_s": 2.0 + i % 2,
             "tokens_per_second": 100.0 * i, "max_token_hit_rate": 0.0, **extra}
            for i in range(1, n + 1)]


@pytest.fixture
def logs(tmp_path):
    root = tmp_path / "logs"
    now = time.time()
    make_run(root / "alive", {"status": "running", "step": 3, "max_steps": 10,
                              "pid": os.getpid(), "host": HOST,
                              "updated_at": now},
             rows(3, bp_action="hold", bp_regime="warmup"), tail=b'{"step": 4, "mean_re')
    make_run(root / "finished", {"status": "completed", "step": 5, "max_steps": 5}, rows(5))
    make_run(root / "crashed", {"status": "failed", "step": 2, "max_steps": 5,
                                "error": "CUDA out of memory\nmore detail"}, rows(2))
    make_run(root / "orphan", {"status": "running", "step": 1, "max_steps": 5,
                               "pid": dead_pid(), "host": HOST}, rows(1))
    far = make_run(root / "elsewhere", {"status": "running", "step": 1, "max_steps": 5,
                                        "pid": 123, "host": "another-host",
                                        "updated_at": now - 3600}, rows(1))
    for f in far.iterdir():  # written an hour ago by a process on another host
        os.utime(f, (now - 3600, now - 3600))
    make_run(root / "queued", {"status": "pending", "max_steps": 5})
    make_run(root / "stopped", {"status": "interrupted", "step": 2, "max_steps": 5}, rows(2))
    make_run(root / "no-state", None, rows(4), config_steps=4)
    return root


def test_run_states_and_fields(logs):
    report = status.scan(logs)
    by = {r.name: r for r in report.runs}
    assert {n: r.state for n, r in by.items()} == {
        "alive": "running", "finished": "completed", "crashed": "failed", "orphan": "stale",
        "elsewhere": "stale", "queued": "pending", "stopped": "interrupted",
        "no-state": "completed"}
    alive = by["alive"]
    assert (alive.step, alive.max_steps) == (3, 10)
    assert alive.mean_reward == pytest.approx(0.3)
    assert alive.median_step_time_s == 3.0 and alive.tokens_per_second == 300.0
    assert alive.max_token_hit_rate == 0.0
    assert (alive.bp_action, alive.bp_regime) == ("hold", "warmup")
    assert alive.bad_lines == 1
    assert by["crashed"].error.startswith("CUDA out of memory")
    assert by["no-state"].max_steps == 4


def test_status_says_the_word_the_files_say():
    """One word per state: state.json's status is shown as it is; `stale` and `unreadable`
    (files that break the summary) are status's own; `skipped` is the manifest's word for a
    run a race did not need (it never started, so it has no state.json)."""
    assert set(status.STATES) == {*runlog.RUN_STATUSES, "stale", "unreadable", "skipped"}


def test_header_counts_match_rows(logs, capsys):
    assert run_app(["status", str(logs)]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first == (f"{logs}: 8 runs (1 running, 2 completed, 1 failed, 2 stale, 1 pending, "
                     "1 interrupted)")
    lines = out.splitlines()
    table = lines[2:lines.index("", 2)]
    assert table[0].split()[:2] == ["run", "state"]
    listed = [line.split()[1] for line in table[1:] if not line.startswith("  ")]
    assert len(listed) == 8  # one row per run counted in the header
    assert sorted(listed) == sorted(["running", "completed", "completed", "failed", "stale",
                                     "stale", "pending", "interrupted"])
    assert "failed: crashed: CUDA out of memory" in out
    assert "bad lines" in out and "\x1b[" not in out


def test_json_output(logs, capsys):
    assert run_app(["status", str(logs), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["runs"]) == 8 and data["campaigns"] == []
    assert sum(data["counts"].values()) == 8
    alive = next(r for r in data["runs"] if r["name"] == "alive")
    assert alive["bp_action"] == "hold" and alive["bad_lines"] == 1


def test_status_points_to_the_back_pressure_picture(logs, capsys):
    alive = logs / "alive"                     # the only run with bp_* metrics
    assert run_app(["status", str(logs)]) == 0
    out = capsys.readouterr().out
    assert f"back-pressure picture: retrain plot {alive}\n" in out
    (alive / runlog.PLOT_FILE).write_bytes(b"\x89PNG")
    assert run_app(["status", str(logs), "--json"]) == 0
    runs = {r["name"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert runs["alive"]["plot"] == str(alive / "usl.png") and runs["finished"]["plot"] is None
    assert run_app(["status", str(logs)]) == 0
    assert f"(last drawn: {alive / 'usl.png'})" in capsys.readouterr().out
    from rich.console import Console

    buf = StringIO()
    Console(file=buf, width=400).print(status_view.rich_view(status.scan(logs)))
    assert f"retrain plot {alive} (last drawn:" in buf.getvalue()


def test_no_picture_hint_without_back_pressure(tmp_path, capsys):
    make_run(tmp_path / "logs" / "plain", {"status": "completed", "step": 2, "max_steps": 2},
             rows(2))
    assert run_app(["status", str(tmp_path / "logs")]) == 0
    assert "retrain plot" not in capsys.readouterr().out


def test_missing_and_empty_folders_are_friendly(tmp_path, capsys):
    assert run_app(["status", str(tmp_path / "nope")]) == 0
    assert "no such folder yet" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert run_app(["status", str(tmp_path / "empty")]) == 0
    out = capsys.readouterr().out
    assert "no runs or campaigns yet" in out and "Traceback" not in out


def test_a_file_instead_of_a_folder_is_a_user_error(tmp_path, capsys):
    f = tmp_path / "config.toml"
    f.write_text("")
    assert run_app(["status", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_status_of_a_single_run_folder(logs):
    report = status.scan(logs / "finished")
    assert [r.name for r in report.runs] == ["finished"] and report.runs[0].state == "completed"


def test_only_garbage_metrics_never_break_status(tmp_path, capsys):
    make_run(tmp_path / "junk", None, tail=b"\x00\xff garbage\n{not json\n[1]\n{\"step\": \"x\"}")
    assert run_app(["status", str(tmp_path)]) == 0
    report = status.scan(tmp_path)
    assert report.runs[0].bad_lines == 3 and report.runs[0].step == 0


# ---------------------------------------------------------------------------- campaigns


def manifest(root, runs, **extra):
    data = {"campaign": "sweep", "status": "running", "parallel": True, "max_workers": 2,
            "max_concurrent": 4, "slots_dir": "slots", "conditions": ["grpo", "rloo"],
            "seeds": [1, 2], "runner": {"pid": os.getpid(), "host": HOST},
            "runs": runs, **extra}
    runlog.write_json_atomic(root / "manifest.json", data)


def entry(name, cond, seed, st, **extra):
    return {"name": name, "condition": cond, "seed": seed, "overrides": {}, "status": st,
            "attempts": 1, "exit_code": None, "pid": 0, "log_dir": name, "last_step": 0,
            "max_steps": 10, **extra}


@pytest.fixture
def campaign(tmp_path):
    root = tmp_path / "logs" / "sweep"
    now = time.time()
    make_run(root / "grpo_s1", {"status": "completed", "step": 10, "max_steps": 10},
             rows(10))
    make_run(root / "grpo_s2", {"status": "running", "step": 4, "max_steps": 10,
                                "pid": os.getpid(), "host": HOST,
                                "updated_at": now}, rows(4), tail=b'{"ste')
    make_run(root / "rloo_s1", {"status": "failed", "step": 1, "max_steps": 10,
                                "error": "boom"}, rows(1))
    manifest(root, [
        entry("grpo_s1", "grpo", 1, "completed", exit_code=0, last_step=10),
        entry("grpo_s2", "grpo", 2, "running"),
        entry("rloo_s1", "rloo", 1, "failed", attempts=2, exit_code=1),
        entry("rloo_s2", "rloo", 2, "pending", attempts=0),
    ])
    make_run(tmp_path / "logs" / "solo", {"status": "completed", "step": 1, "max_steps": 1},
             rows(1))
    return tmp_path / "logs"


def test_campaign_matrix_counts_and_time_left(campaign):
    report = status.scan(campaign)
    assert [r.name for r in report.runs] == ["solo"]  # campaign runs are not listed twice
    (c,) = report.campaigns
    assert c.name == "sweep" and c.state == "running"
    states = {r.name: r.state for r in c.runs}
    assert states == {"grpo_s1": "completed", "grpo_s2": "running", "rloo_s1": "failed",
                      "rloo_s2": "pending"}
    assert c.counts == {"running": 1, "completed": 1, "failed": 1, "pending": 1}
    assert {r.name: r.attempts for r in c.runs}["rloo_s1"] == 2
    # open runs: grpo_s2 (6 steps left) + rloo_s2 (10); median step 2.5s; 2 workers
    assert c.steps_left == 16
    assert c.time_left_s == pytest.approx(2.5 * 16 / 2)
    assert c.api_slots_in_use is None or isinstance(c.api_slots_in_use, int)


def test_campaign_plain_output(campaign, capsys):
    assert run_app(["status", str(campaign)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{campaign}: 1 run (1 completed), 1 campaign"
    assert "campaign 'sweep'" in out
    assert "4 runs (1 running, 1 completed, 1 failed, 1 pending)" in out
    assert "16 steps left, ~20s" in out
    matrix = [line for line in out.splitlines() if line.startswith("  grpo ")]
    assert matrix and "completed 10/10" in matrix[0] and "running 4/10" in matrix[0]
    rloo = [line for line in out.splitlines() if line.startswith("  rloo ")][0]
    assert "failed 1/10 (x2)" in rloo and "pending 0/10" in rloo
    assert "failed: rloo_s1: boom" in out


def test_campaign_slots_in_use(campaign, monkeypatch, capsys):
    sem = types.ModuleType("retrain.slots.file_slots")
    seen = []
    sem.slots_in_use = lambda folder: seen.append(folder) or 3
    monkeypatch.setitem(sys.modules, "retrain.slots.file_slots", sem)
    (c,) = status.scan(campaign).campaigns
    assert c.api_slots_in_use == 3 and seen == [campaign / "sweep" / "slots"]
    assert "API slots 3/4 in use" in status_view.campaign_header(c)


def test_dead_campaign_runner_is_stale_and_running_entry_without_folder(tmp_path):
    root = tmp_path / "c"
    manifest(root, [entry("grpo_s1", "grpo", 1, "running", pid=dead_pid()),
                    entry("grpo_s2", "grpo", 2, "interrupted", last_step=3)],
             runner={"pid": dead_pid(), "host": HOST})
    (c,) = status.scan(tmp_path).campaigns
    assert c.state == "stale"
    assert [r.state for r in c.runs] == ["stale", "interrupted"]
    assert c.runs[1].step == 3
    assert c.time_left_s is None and c.steps_left == 17


def test_broken_manifest_is_tolerated(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text('{"runs": [1, {"name": "x"}, "y"], "seeds": 3')
    assert run_app(["status", str(tmp_path)]) == 0
    (tmp_path / "c" / "manifest.json").write_text('{"runs": [1, {"name": "x"}], "seeds": 3}')
    assert run_app(["status", str(tmp_path), "--json"]) == 0
    capsys.readouterr()


def test_rich_and_watch(campaign, monkeypatch, capsys):
    monkeypatch.setattr(status_view.render, "stdout_is_terminal", lambda: True)
    monkeypatch.setenv("COLUMNS", "200")
    assert run_app(["status", str(campaign)]) == 0
    out = capsys.readouterr().out
    assert "sweep" in out and "grpo_s2" in out
    from rich.console import Console

    buf = StringIO()
    status_view.watch_status(campaign, interval=0.01, iterations=2,
                             console=Console(file=buf, force_terminal=True, width=150))
    assert "grpo_s2" in buf.getvalue()


def test_watch_when_piped_prints_plain_reports(campaign, capsys):
    status_view.watch_status(campaign, interval=0.01, iterations=1)
    out = capsys.readouterr().out
    assert out.count("campaign 'sweep'") == 2 and "\x1b[" not in out


def test_watch_and_json_do_not_mix(tmp_path, capsys):
    assert run_app(["status", str(tmp_path), "--watch", "--json"]) == 2
    assert "do not mix" in capsys.readouterr().err


def test_status_shows_mean_turns_of_an_environment_run(tmp_path):
    root = tmp_path / "logs"
    make_run(root / "game", {"status": "completed", "step": 2, "max_steps": 2},
             rows(2, mean_turns=3.25))
    make_run(root / "task", {"status": "completed", "step": 2, "max_steps": 2}, rows(2))
    game, task = sorted(status.scan(root).runs, key=lambda r: r.name)
    assert game.mean_turns == 3.25 and task.mean_turns is None
    table = status_view.runs_table([game, task])
    assert "3.25 turns" in table.rows[0][3] and "turns" not in table.rows[1][3]


def test_campaign_auto_cap_and_why(campaign, capsys):
    """max_concurrent = "auto": status shows the controller's current cap and its reason."""
    log = campaign / "sweep" / "concurrency.jsonl"
    log.write_text(json.dumps({"time": 1.0, "cap": 8, "reason": "warm-up: try 8"}) + "\n"
                   + "{torn line\n"
                   + json.dumps({"time": 2.0, "cap": 6, "reason": "overload: cut to 6"}) + "\n")
    (c,) = status.scan(campaign).campaigns
    assert c.api_cap == 6 and c.api_cap_reason == "overload: cut to 6"
    assert "API cap 6 (auto; " in status_view.campaign_header(c)
    assert "last: overload: cut to 6)" in status_view.campaign_header(c)
    assert run_app(["status", str(campaign), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["campaigns"][0]["api_cap"] == 6


def test_rewards_near_the_float_limit_never_hide_the_other_runs(campaign, capsys):
    """Finite rewards of 1e308 in one campaign: status still shows every run of the folder,
    and the campaign's seed comparison."""
    from tests.results_helpers import write_campaign

    write_campaign(campaign / "huge", {
        ("big", 1): {"rewards": [1e308] * 3, "step_time_s": 1e308},
        ("big", 2): {"rewards": [1.7e308] * 3, "tokens_per_second": 1.7e308}})
    assert run_app(["status", str(campaign)]) == 0
    out = capsys.readouterr().out
    assert "solo" in out and "grpo_s2" in out and "big_s2" in out
    assert "1.35e+308" in out  # the final reward of condition big, over its two seeds
    assert run_app(["status", str(campaign), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    huge = next(c for c in report["campaigns"] if c["name"] == "huge")
    assert huge["comparison"]["conditions"][0]["final_reward"]["mean"] == pytest.approx(1.35e308)
    assert [r["name"] for r in report["runs"]] == ["solo"]


def test_a_run_that_breaks_the_summary_is_shown_unreadable_beside_the_others(
        campaign, monkeypatch, capsys):
    """Whatever breaks one run's summary (here a fault put into reading its metrics), that
    run is listed as unreadable with the reason and every other run still shows."""
    real = runlog.read_metrics

    def broken_for_one(path):
        if "grpo_s2" in str(path) or "solo" in str(path):
            raise OverflowError("a fault in this run's files")
        return real(path)

    monkeypatch.setattr(runlog, "read_metrics", broken_for_one)
    assert run_app(["status", str(campaign)]) == 0
    out = capsys.readouterr().out
    assert "unreadable: solo: OverflowError: a fault in this run's files" in out
    assert "grpo_s1" in out and "rloo_s1" in out and "grpo_s2" in out
    report = status.scan(campaign)
    assert report.counts == {"unreadable": 1}
    (c,) = report.campaigns
    assert {r.name: r.state for r in c.runs}["grpo_s2"] == "unreadable"


def test_status_shows_tokens_and_cost_per_run_and_per_campaign(tmp_path):
    """The bill (docs/cost.md): each run's rows summed, priced by its config's [cost]; a run
    with no price shows device-hours, never dollars; a campaign sums its runs."""
    camp = tmp_path / "logs" / "camp"
    spend = {"prefill_tokens": 100, "sampled_tokens": 50, "trained_tokens": 150,
             "wall_s": 1800.0}
    priced = make_run(camp / "priced", {"status": "completed", "step": 2, "max_steps": 2},
                      rows(2, **spend))
    (priced / "config.toml").write_text("[cost]\nsample_per_mtok = 1000.0\nprefill_per_mtok = 0"
                                        "\ntrain_per_mtok = 0\ndevice_hour = 0\n")
    make_run(camp / "unpriced", {"status": "budget", "step": 1, "max_steps": 2,
                                 "error": "spent 300 tokens"}, rows(1, **spend))
    runlog.write_json_atomic(camp / "manifest.json", {
        "campaign": "camp", "status": "budget", "runs": [
            {"name": n, "condition": "c", "seed": s, "log_dir": n, "status": st}
            for n, s, st in (("priced", 1, "completed"), ("unpriced", 2, "budget"))]})
    report = status.scan(tmp_path / "logs")
    [c] = report.campaigns
    by_name = {r.name: r for r in c.runs}
    assert by_name["priced"].bill.text() == "600 tok, $0.1000"  # 100 sampled x $1000/Mtok
    assert by_name["unpriced"].bill.text() == "300 tok, 0.5 device-h"
    assert by_name["unpriced"].state == "budget"
    assert c.bill.spent.tokens == 900 and c.bill.usd == pytest.approx(0.1)
    out = "\n".join(status_view.plain_lines(report))
    assert "spent 900 tok, $0.1000 (part unpriced)" in out and "600 tok, $0.1000  " in out
