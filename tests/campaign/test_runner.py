"""The campaign runner with a fake worker (a small script that behaves like the trainer:
state.json, metrics.jsonl, resume from its last step, SIGTERM -> checkpoint + exit 143),
plugged in through the Executor seam."""

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
from retrain.campaign.manifest import load_manifest, save_manifest
from retrain.campaign.runner import locate_campaign, log_tail, run_campaign
from retrain.config import toml_io
from retrain.config.loader import load, load_config, loads_config
from retrain.config.sections import ConfigError
from retrain.errors import UserError
from retrain.runfiles import runlog

REPO = Path(__file__).resolve().parents[2]

FAKE_WORKER = textwrap.dedent('''
    """Behaves like `retrain run <config>` as far as the runner can tell."""
    import json, os, signal, sys, time, tomllib
    from pathlib import Path
    from retrain.runfiles import runlog
    from retrain.slots.file_slots import slots_from_env

    cfg = tomllib.loads(Path(sys.argv[1]).read_text())
    opts = cfg["backend"]["options"]
    run_dir = Path(cfg["logging"]["log_dir"]) / cfg["logging"]["run_name"]
    events = os.environ["FAKE_EVENTS"]
    name = cfg["logging"]["run_name"]

    def event(tag):
        with open(events, "a") as fh:
            fh.write(json.dumps({"tag": tag, "run": name, "t": time.time(), "pid": os.getpid(),
                                 "slots": os.environ.get("RETRAIN_API_SLOTS")}) + "\\n")

    state = runlog.load_state(run_dir) or runlog.RunState()
    if state.status == "completed" and state.step >= cfg["training"]["max_steps"]:
        sys.exit(0)
    state.status, state.pid, state.max_steps = "running", os.getpid(), cfg["training"]["max_steps"]
    runlog.save_state(run_dir, state)
    event("start")
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    attempts_file = run_dir / "fake_attempts"
    attempt = int(attempts_file.read_text()) + 1 if attempts_file.exists() else 1
    # atomically: a test SIGKILLs workers at any moment; a half-written count reads empty
    (run_dir / "fake_attempts.tmp").write_text(str(attempt))
    os.replace(run_dir / "fake_attempts.tmp", attempts_file)
    slots = slots_from_env()
    hold = os.environ.get("FAKE_HOLD")  # after step 1, wait for this file (or a signal)
    with runlog.MetricsWriter(run_dir / runlog.METRICS_FILE) as metrics:
        for step in range(state.step + 1, state.max_steps + 1):
            while hold and step > 1 and not stop and not Path(hold).exists():
                time.sleep(0.01)
            if stop:
                state.status = "interrupted"
                runlog.save_state(run_dir, state)
                event("interrupted")
                sys.exit(143)
            if opts.get("fail_at") == step and attempt <= opts.get("fail_attempts", 99):
                print("boom: fake failure at step", step, flush=True)
                event("fail")
                sys.exit(3)
            with slots:
                time.sleep(opts.get("step_s", 0.05))
            metrics.write({"step": step, "mean_reward": cfg["training"]["seed"] / 10,
                           "correct_rate": 0.5, "lr": cfg["training"]["lr"]})
            state.step = step
            runlog.save_state(run_dir, state)
    state.status = "completed"
    runlog.save_state(run_dir, state)
    event("end")
''')

DRIVER = textwrap.dedent('''
    import sys
    from retrain.campaign.executor import LocalExecutor
    from retrain.campaign.runner import run_campaign
    from retrain.config.loader import load
    path, fake = sys.argv[1], sys.argv[2]
    new = "--new" in sys.argv
    sys.exit(run_campaign(*load(path), path, new=new,
                          executor=LocalExecutor([sys.executable, fake])))
''')

BASE = """
[training]
max_steps = 3
lr = 1e-4
[backend.options]
step_s = {step_s}
[logging]
log_dir = "{log_dir}"
[campaign]
seeds = [1, 2]
parallel = {parallel}
max_workers = {max_workers}
stagger_seconds = {stagger}
max_retries = 1
[[campaign.conditions]]
name = "a"
[[campaign.conditions]]
name = "b"
"training.lr" = 2e-4
"""


@pytest.fixture
def env(tmp_path, monkeypatch):
    fake = tmp_path / "fake_worker.py"
    fake.write_text(FAKE_WORKER)
    (tmp_path / "driver.py").write_text(DRIVER)
    monkeypatch.setenv("FAKE_EVENTS", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return tmp_path


def _write(tmp: Path, extra: str = "", name: str = "exp", **kw) -> Path:
    params = {"step_s": 0.05, "log_dir": str(tmp / "logs"), "parallel": "true",
              "max_workers": 2, "stagger": 0.2, **kw}
    path = tmp / f"{name}.toml"
    path.write_text(BASE.format(**params) + extra)
    return path


def _run(tmp: Path, path: Path, **kw) -> int:
    executor = ex.LocalExecutor([sys.executable, str(tmp / "fake_worker.py")])
    return run_campaign(*load(path), path, executor=executor, **kw)


def _events(tmp: Path) -> list[dict]:
    path = tmp / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _max_alive(events: list[dict]) -> int:
    alive = peak = 0
    for e in sorted(events, key=lambda e: e["t"]):
        alive += {"start": 1}.get(e["tag"], -1)
        peak = max(peak, alive)
    return peak


def test_parallel_campaign_completes_with_a_full_manifest(env, capsys):
    path = _write(env, step_s=0.2)
    assert _run(env, path) == 0
    m = load_manifest(env / "logs" / "exp")
    assert m is not None and m.status == "completed"
    assert [r.name for r in m.runs] == ["a_s1", "a_s2", "b_s1", "b_s2"]
    assert m.conditions == ["a", "b"] and m.seeds == [1, 2]
    assert (m.parallel, m.max_workers, m.stagger_seconds, m.slots_dir) == (True, 2, 0.2, "slots")
    assert m.config_file == str(path.resolve()) and len(m.config_hash) == 16
    for r in m.runs:
        assert (r.status, r.attempts, r.exit_code, r.last_step, r.max_steps) == (
            "completed", 1, 0, 3, 3)
        assert r.final_metrics["step"] == 3
        assert r.final_metrics["mean_reward"] == pytest.approx(r.seed / 10)
        assert r.final_metrics["lr"] == (2e-4 if r.condition == "b" else 1e-4)
        assert r.started_at < r.ended_at and r.log_dir == r.name and r.pid > 0
        assert (env / "logs" / "exp" / r.name / "worker.log").exists()
    starts = sorted(r.started_at for r in m.runs)
    assert all(b - a >= 0.2 for a, b in zip(starts, starts[1:], strict=False))
    events = _events(env)
    assert _max_alive(events) == 2
    slots = {e["slots"] for e in events}
    assert slots == {f"{(env / 'logs' / 'exp' / 'slots').resolve()}:4"}
    out = capsys.readouterr().out
    assert "4 runs: 4 completed" in out and "a_s1" in out


def test_stagger_counts_from_the_spawn_not_from_before_a_slow_launch(env, monkeypatch):
    # CI once saw starts 0.29 s apart with stagger 0.3: the clock started before a slow
    # fsync'd config write. Make the first launch slow and check the gap still holds.
    from retrain.campaign import runner as runner_mod
    real, calls = runner_mod.write_run_config, []

    def slow_first(plan):
        calls.append(plan)
        if len(calls) == 1:
            time.sleep(0.5)
        return real(plan)

    monkeypatch.setattr(runner_mod, "write_run_config", slow_first)
    path = _write(env, max_workers=4, stagger=0.3)
    assert _run(env, path) == 0
    m = load_manifest(env / "logs" / "exp")
    starts = sorted(r.started_at for r in m.runs)
    assert min(b - a for a, b in zip(starts, starts[1:], strict=False)) >= 0.3


def test_serial_campaign_runs_one_process_at_a_time(env):
    path = _write(env, parallel="false", stagger=5.0)
    t0 = time.monotonic()
    assert _run(env, path) == 0
    assert time.monotonic() - t0 < 15  # stagger does not apply when not parallel
    events = _events(env)
    assert _max_alive(events) == 1
    assert len({e["pid"] for e in events}) == 4


def test_max_workers_zero_means_all_at_once(env):
    path = _write(env, max_workers=0, stagger=0.0, step_s=0.3)
    assert _run(env, path) == 0
    assert _max_alive(_events(env)) == 4


def test_failed_run_is_recorded_others_go_on_and_retries_are_bounded(env, capsys):
    extra = '[[campaign.conditions]]\nname = "bad"\n"backend.options.fail_at" = 2\n'
    path = _write(env, extra)
    assert _run(env, path) == 1
    m = load_manifest(env / "logs" / "exp")
    by = {r.name: r for r in m.runs}
    assert m.status == "failed"
    assert [by[n].status for n in ("bad_s1", "bad_s2")] == ["failed", "failed"]
    assert all(by[n].status == "completed" for n in ("a_s1", "a_s2", "b_s1", "b_s2"))
    bad = by["bad_s1"]
    assert (bad.exit_code, bad.failures, bad.attempts, bad.last_step) == (3, 1, 1, 1)
    assert "boom: fake failure at step 2" in bad.error
    out = capsys.readouterr().out
    assert "2 run(s) failed" in out and "boom: fake failure" in out
    assert "6 runs: 4 completed, 2 failed" in out

    (env / "events.jsonl").unlink()
    assert _run(env, path) == 1  # the retry: only the failed runs start, and fail again
    assert sorted(e["run"] for e in _events(env) if e["tag"] == "start") == ["bad_s1", "bad_s2"]
    (env / "events.jsonl").unlink()
    assert _run(env, path) == 1  # failures (2) > max_retries (1): given up, nothing starts
    assert _events(env) == []
    assert "failed too often" in capsys.readouterr().out


def test_a_retry_that_succeeds_resumes_from_its_last_step(env):
    extra = ('[[campaign.conditions]]\nname = "flaky"\n"backend.options.fail_at" = 3\n'
             '"backend.options.fail_attempts" = 1\n')
    path = _write(env, extra)
    assert _run(env, path) == 1
    assert _run(env, path) == 0
    m = load_manifest(env / "logs" / "exp")
    flaky = m.entry("flaky_s1")
    assert (flaky.status, flaky.attempts, flaky.failures, flaky.last_step) == (
        "completed", 2, 1, 3)
    steps = [r["step"] for r in runlog.read_metrics(env / "logs/exp/flaky_s1/metrics.jsonl").rows]
    assert steps == [1, 2, 3]


def test_same_toml_again_skips_completed_runs(env):
    path = _write(env)
    assert _run(env, path) == 0
    (env / "events.jsonl").unlink()
    assert _run(env, path) == 0
    assert _events(env) == []
    changed_scheduling = _write(env, max_workers=4, stagger=0.0)
    assert _run(env, changed_scheduling) == 0  # scheduling keys are not part of the matrix


def test_keys_a_newer_retrain_added_at_their_defaults_are_no_change(env):
    """A campaign written before a key existed resumes after the upgrade: its config.toml
    files lack the key and the manifest's hash covered the old key set."""
    path = _write(env)
    assert _run(env, path) == 0
    campaign = env / "logs" / "exp"
    for toml in campaign.glob("*_s*/config.toml"):
        raw = toml_io.loads(toml.read_text())
        del raw["environment"]  # the section this retrain added
        toml.write_text(toml_io.dumps(raw))
    m = load_manifest(campaign)
    m.config_hash = "written-by-an-older-retrain"
    save_manifest(campaign, m)
    (env / "events.jsonl").unlink()
    assert _run(env, path) == 0
    assert _events(env) == []
    path.write_text(path.read_text().replace("max_steps = 3", "max_steps = 4"))
    with pytest.raises(UserError, match=r"training.max_steps: 3 -> 4"):
        _run(env, path)  # a real change is still refused


def test_changed_matrix_is_refused_then_forced_or_new(env, capsys):
    path = _write(env)
    assert _run(env, path) == 0
    text = path.read_text().replace("max_steps = 3", "max_steps = 4")
    path.write_text(text + '[[campaign.conditions]]\nname = "c"\n')
    with pytest.raises(UserError) as err:
        _run(env, path)
    msg = str(err.value)
    assert "matrix changed" in msg and "--new" in msg and "--force" in msg
    assert "new runs: c_s1, c_s2" in msg
    assert "training.max_steps: 3 -> 4 (4 runs)" in msg
    (env / "events.jsonl").unlink()
    assert _run(env, path, force=True) == 0
    started = sorted(e["run"] for e in _events(env) if e["tag"] == "start")
    assert started == ["a_s1", "a_s2", "b_s1", "b_s2", "c_s1", "c_s2"]  # 3 -> 4 steps: continue
    m = load_manifest(env / "logs" / "exp")
    assert len(m.runs) == 6 and {r.last_step for r in m.runs} == {4}

    path.write_text(text)  # drop condition c: under --force its history is retired, not lost
    assert _run(env, path, force=True) == 0
    m = load_manifest(env / "logs" / "exp")
    assert [r.name for r in m.retired_runs] == ["c_s1", "c_s2"]
    assert (env / "logs/exp/c_s1/metrics.jsonl").exists()

    assert _run(env, path, new=True) == 0
    assert load_manifest(env / "logs" / "exp-2").status == "completed"
    assert load_manifest(env / "logs" / "exp") is not None  # old data kept
    (env / "events.jsonl").unlink()
    assert _run(env, path) == 0  # the same TOML now finds the newest campaign, exp-2
    assert _events(env) == []


def test_campaign_name_from_config(env):
    path = _write(env, name="whatever")
    text = path.read_text().replace("max_retries = 1", 'max_retries = 1\nname = "../Nice name"')
    path.write_text(text)
    assert _run(env, path) == 0
    assert load_manifest(env / "logs" / "Nice-name").campaign == "Nice-name"


def test_locate_campaign(tmp_path):
    assert locate_campaign(tmp_path, "x", new=False) == tmp_path / "x"
    assert locate_campaign(tmp_path, "x", new=True) == tmp_path / "x"
    (tmp_path / "x").mkdir()
    (tmp_path / "x-3").mkdir()
    (tmp_path / "x-y").mkdir()
    (tmp_path / "xx").mkdir()
    assert locate_campaign(tmp_path, "x", new=False) == tmp_path / "x-3"
    assert locate_campaign(tmp_path, "x", new=True) == tmp_path / "x-4"


def test_a_single_run_folder_is_not_taken_over(env):
    path = _write(env)
    runlog.save_state(env / "logs" / "exp", runlog.RunState(status="completed"))
    with pytest.raises(UserError, match="holds a single run"):
        _run(env, path)
    assert _run(env, path, new=True) == 0
    assert load_manifest(env / "logs" / "exp-2").status == "completed"


def test_bad_override_is_a_config_error_not_a_traceback(env):
    path = _write(env, '[[campaign.conditions]]\nname = "x"\n"training.seed" = 3\n')
    with pytest.raises(ConfigError) as err:
        _run(env, path)
    assert str(err.value).startswith(str(path.resolve()))
    assert '"training.seed": cannot be set per run: vary the seed with [campaign].seeds' in str(
        err.value)


def _driver(env: Path, path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(env / "driver.py"), str(path),
                             str(env / "fake_worker.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _started(env: Path, n: int) -> bool:
    return sum(e["tag"] == "start" for e in _events(env)) >= n


@pytest.fixture
def held(env, monkeypatch) -> Path:
    """The fake workers wait after their first step until this file exists: a test that
    signals or kills them once all have started finds none finished, however loaded the
    machine (at 0.2 s a step, one did finish first under the full suite)."""
    release = env / "release"
    monkeypatch.setenv("FAKE_HOLD", str(release))
    return release


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_is_forwarded_workers_checkpoint_and_resume(env, held, sig, code):
    path = _write(env, max_workers=4, stagger=0.0, step_s=0.2)
    runner = _driver(env, path)
    _wait_for(lambda: _started(env, 4))
    runner.send_signal(sig)
    out, _ = runner.communicate(timeout=60)
    assert runner.returncode == code, out
    assert "asking 4 worker(s) to checkpoint" in out
    m = load_manifest(env / "logs" / "exp")
    assert m.status == "interrupted"
    assert {r.status for r in m.runs} == {"interrupted"}
    assert sum(e["tag"] == "interrupted" for e in _events(env)) == 4
    assert all(runlog.load_state(env / "logs/exp" / r.name).status == "interrupted"
               for r in m.runs)
    held.touch()
    assert _run(env, path) == 0
    for r in load_manifest(env / "logs" / "exp").runs:
        steps = [x["step"] for x in runlog.read_metrics(env / "logs/exp" / r.name /
                                                          "metrics.jsonl").rows]
        assert steps == [1, 2, 3] and r.attempts == 2 and r.failures == 0


def test_sigkilled_runner_dead_workers_are_resumed(env, held):
    path = _write(env, max_workers=4, stagger=0.0, step_s=0.3)
    runner = _driver(env, path)
    _wait_for(lambda: _started(env, 4))
    m = load_manifest(env / "logs" / "exp")
    pids = [r.pid for r in m.runs]
    runner.kill()
    runner.wait()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert load_manifest(env / "logs" / "exp").status == "running"
    held.touch()
    assert _run(env, path) == 0
    m = load_manifest(env / "logs" / "exp")
    assert all(r.status == "completed" and r.attempts == 2 for r in m.runs)


def test_sigkilled_runner_live_workers_are_adopted(env, held, capsys):
    path = _write(env, max_workers=4, stagger=0.0, step_s=0.3)
    runner = _driver(env, path)
    _wait_for(lambda: _started(env, 4))
    runner.kill()
    runner.wait()
    held.touch()
    assert _run(env, path) == 0
    assert "still running from a previous runner" in capsys.readouterr().out
    m = load_manifest(env / "logs" / "exp")
    assert all(r.status == "completed" and r.attempts == 1 for r in m.runs)
    assert sum(e["tag"] == "start" for e in _events(env)) == 4  # nothing started twice


def test_two_runners_on_one_campaign_are_refused(env):
    path = _write(env, max_workers=1, stagger=0.0, step_s=0.3)
    runner = _driver(env, path)
    _wait_for(lambda: _started(env, 1))
    with pytest.raises(UserError, match="already being run"):
        _run(env, path)
    runner.send_signal(signal.SIGTERM)
    runner.communicate(timeout=60)


def test_worker_killed_is_failed_and_only_it_reruns(env):
    path = _write(env, max_workers=4, stagger=0.0, step_s=0.4)
    runner = _driver(env, path)
    _wait_for(lambda: _started(env, 4))
    victim = next(e for e in _events(env) if e["run"] == "b_s1")
    os.kill(victim["pid"], signal.SIGKILL)
    out, _ = runner.communicate(timeout=60)
    assert runner.returncode == 1, out
    assert "killed by SIGKILL" in out and "1 run(s) failed" in out
    m = load_manifest(env / "logs" / "exp")
    assert m.entry("b_s1").status == "failed" and m.entry("b_s1").exit_code == -9
    (env / "events.jsonl").unlink()
    assert _run(env, path) == 0
    assert [e["run"] for e in _events(env) if e["tag"] == "start"] == ["b_s1"]


class _InstantWorker:
    def __init__(self, job: ex.Job, log: list):
        self.pid, self.job = 10_000 + len(log), job
        log.append(job)

    def poll(self) -> int:
        cfg = loads_config(self.job.config_path.read_text())
        run_dir = Path(cfg.logging.log_dir) / cfg.logging.run_name
        runlog.save_state(run_dir, runlog.RunState(status="completed", step=cfg.training.max_steps))
        return 0

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def test_executor_seam_takes_any_executor(env):
    launched: list[ex.Job] = []

    class Fake:
        def launch(self, job: ex.Job) -> ex.Worker:
            return _InstantWorker(job, launched)

    path = _write(env, stagger=0.0)
    assert run_campaign(*load(path), path, executor=Fake()) == 0
    assert [j.name for j in launched] == ["a_s1", "a_s2", "b_s1", "b_s2"]
    job = launched[0]
    assert job.config_path == env / "logs/exp/a_s1/config.toml"
    assert job.env["RETRAIN_API_SLOTS"].endswith("/logs/exp/slots:4")
    run_cfg, run_plan = load(job.config_path)
    assert run_plan is None and run_cfg.logging.log_dir == str(env / "logs" / "exp")
    assert load_manifest(env / "logs/exp").entry("b_s2").last_step == 3


def test_paths_a_condition_sets_are_anchored_to_the_campaign_toml(env):
    (env / "data").mkdir()
    (env / "data" / "x.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    path = _write(env, '[[campaign.conditions]]\nname = "j"\n"data.source" = "jsonl"\n'
                       '"data.path" = "data/x.jsonl"\n', stagger=0.0)
    launched: list[ex.Job] = []

    class Fake:
        def launch(self, job: ex.Job) -> ex.Worker:
            return _InstantWorker(job, launched)

    assert run_campaign(*load(path), path, executor=Fake()) == 0
    job = next(j for j in launched if j.name == "j_s1")
    assert load_config(job.config_path).data.path == str(env / "data" / "x.jsonl")


def test_log_tail_shows_only_the_last_attempt(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("\n=== attempt 1 of x ===\nold error\n\n=== attempt 2 of x ===\n"
                   + "".join(f"line {i}\n" for i in range(30)))
    tail = log_tail(log)
    assert "old error" not in tail and tail.splitlines()[-1] == "line 29"
    assert len(tail.splitlines()) == 15
    assert log_tail(tmp_path / "missing.log") == ""


def test_forced_max_steps_raise_continues_finished_runs(env):
    path = _write(env, stagger=0.0)
    assert _run(env, path) == 0
    path.write_text(path.read_text().replace("max_steps = 3", "max_steps = 5"))
    with pytest.raises(UserError, match=r"training.max_steps: 3 -> 5 \(4 runs\)"):
        _run(env, path)
    assert _run(env, path, force=True) == 0
    m = load_manifest(env / "logs" / "exp")
    assert all((r.status, r.last_step, r.max_steps, r.attempts) == ("completed", 5, 5, 2)
               for r in m.runs)
    run_dir = env / "logs" / "exp" / "a_s1"
    assert [r["step"] for r in runlog.read_metrics(run_dir / "metrics.jsonl").rows] == [
        1, 2, 3, 4, 5]
    # The worker got the new config beside the one the run started from, to compare them.
    assert "max_steps = 5" in (run_dir / "config.next.toml").read_text()
    assert "max_steps = 3" in (run_dir / "config.toml").read_text()


def test_a_raised_max_steps_continues_a_run_with_sft_steps(tmp_path):
    """A completed run whose 6 [sft] steps preceded its 2 RL steps stands at step 8: raising
    training.max_steps to 4 (--force) makes it pending again, as for a run without SFT."""
    from retrain.campaign.manifest import Manifest, RunEntry
    from retrain.campaign.matrix import RunSpec
    from retrain.campaign.run_records import PlannedRun, _merge, record_progress
    from retrain.config.sections import Config

    run_dir = tmp_path / "a_s1"
    runlog.save_state(run_dir, runlog.RunState(status="completed", step=8, max_steps=8,
                                               extra={"sft_steps": 6}))
    entry = RunEntry(name="a_s1", condition="a", seed=1, status="completed", max_steps=2)
    record_progress(entry, run_dir, final=True)
    assert (entry.last_step, entry.max_steps) == (8, 8)  # shown as 8/8, not 8/2
    cfg = Config()
    cfg.training.max_steps = 4
    plan = PlannedRun(RunSpec("a_s1", "a", 1), cfg, run_dir)
    merged = _merge(Manifest("exp", "exp.toml", "old", runs=[entry]), [plan], "new")
    assert merged.runs[0].status == "pending"
    cfg.training.max_steps = 2  # not raised: it stays finished
    entry.status = "completed"
    assert _merge(Manifest("exp", "exp.toml", "old", runs=[entry]), [plan],
                  "new").runs[0].status == "completed"


DIES_AFTER_SPAWN = textwrap.dedent('''
    import os, signal, sys
    from retrain.campaign.executor import LocalExecutor
    from retrain.campaign.runner import run_campaign
    from retrain.config.loader import load

    class DiesAfterSpawn(LocalExecutor):
        def launch(self, job):
            super().launch(job)
            os.kill(os.getpid(), signal.SIGKILL)  # the runner dies before it records the pid

    path, fake = sys.argv[1], sys.argv[2]
    sys.exit(run_campaign(*load(path), path, executor=DiesAfterSpawn([sys.executable, fake])))
''')


def test_a_runner_killed_between_starting_a_worker_and_recording_it_starts_nothing_twice(env):
    """The manifest says 'running' before the worker starts, so the next runner looks for it
    (by the config in its command line) and watches it instead of starting the run again."""
    path = _write(env, max_workers=1, stagger=0.0, step_s=0.3)
    (env / "dies.py").write_text(DIES_AFTER_SPAWN)
    dead = subprocess.run([sys.executable, str(env / "dies.py"), str(path),
                           str(env / "fake_worker.py")], capture_output=True, text=True)
    assert dead.returncode == -signal.SIGKILL
    entry = load_manifest(env / "logs" / "exp").entry("a_s1")
    assert (entry.status, entry.attempts, entry.pid) == ("running", 1, 0)
    assert _run(env, path) == 0
    m = load_manifest(env / "logs" / "exp")
    assert all(r.status == "completed" and r.attempts == 1 for r in m.runs)
    starts = [e["run"] for e in _events(env) if e["tag"] == "start"]
    assert sorted(starts) == ["a_s1", "a_s2", "b_s1", "b_s2"]  # a_s1 once, by the dead runner


def test_reordered_seeds_are_named_not_shown_as_two_hashes(env):
    path = _write(env)
    assert _run(env, path) == 0
    (env / "logs" / "exp" / "a_s2" / "config.toml").unlink()  # a run folder not written yet
    path.write_text(path.read_text().replace("seeds = [1, 2]", "seeds = [2, 1]"))
    with pytest.raises(UserError) as err:
        _run(env, path)
    msg = str(err.value)
    assert "matrix changed" in msg and "seed order: 1, 2 -> 2, 1" in msg and "hash" not in msg
