"""Real campaigns on the tiny model through the real CLI: scheduling, manifest, status,
a SIGKILLed worker, and a re-run that runs only what failed."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.tiny_campaign import tiny_campaign_toml
from retrain.campaign.manifest import load_manifest
from retrain.runfiles import runlog

CONDITIONS = """
[[campaign.conditions]]
name = "grpo"
[[campaign.conditions]]
name = "rloo"
"algorithm.advantage" = "rloo"
"""


def _toml(tmp: Path, *, max_steps: int = 2, seeds: str = "[1, 2]", max_workers: int = 2,
          stagger: float = 0.3) -> Path:
    path = tmp / "exp.toml"
    path.write_text(tiny_campaign_toml(tmp / "logs", seeds, max_steps=max_steps,
                                       max_workers=max_workers, stagger_s=stagger,
                                       tables=CONDITIONS))
    return path


def _retrain(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "retrain", *args], env=env, text=True,
                          capture_output=True, timeout=timeout)


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    alive = peak = 0
    for _, d in edges:
        alive += d
        peak = max(peak, alive)
    return peak


def test_four_runs_two_workers_stagger_manifest_and_status(tmp_path, cli_env, tiny_model):
    path = _toml(tmp_path)
    done = _retrain(cli_env, "run", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    m = load_manifest(tmp_path / "logs" / "exp")
    assert m is not None and m.status == "completed"
    assert [r.name for r in m.runs] == ["grpo_s1", "grpo_s2", "rloo_s1", "rloo_s2"]
    # Runner-side lifetimes (launch .. reaped) contain the real ones, so this bounds them.
    lifetimes = [(r.started_at, r.ended_at) for r in m.runs]
    assert _max_overlap(lifetimes) == 2
    starts = sorted(a for a, _ in lifetimes)
    assert min(b - a for a, b in zip(starts, starts[1:], strict=False)) >= 0.3
    for r in m.runs:
        run_dir = tmp_path / "logs" / "exp" / r.name
        assert (r.status, r.attempts, r.exit_code, r.last_step, r.max_steps) == (
            "completed", 1, 0, 2, 2)
        assert {"mean_reward", "loss", "step_time_s", "api_wait_s"} <= set(r.final_metrics)
        rows = runlog.read_metrics(run_dir / "metrics.jsonl").rows
        assert [row["step"] for row in rows] == [1, 2]
        state = runlog.load_state(run_dir)
        assert state.status == "completed" and Path(state.checkpoint).is_relative_to(run_dir)
        run_cfg = (run_dir / "config.toml").read_text()
        assert f'seed = {r.seed}' in run_cfg and "[[campaign.conditions]]" not in run_cfg
        assert ('advantage = "rloo"' in run_cfg) == (r.condition == "rloo")
        assert "step 2/2" in (run_dir / "worker.log").read_text()
    assert "4 runs: 4 completed" in done.stdout

    status = _retrain(cli_env, "status", str(tmp_path / "logs"), "--json", timeout=60)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    (camp,) = report["campaigns"]
    assert camp["name"] == "exp"
    assert sorted(r["name"] for r in camp["runs"]) == [r.name for r in m.runs]
    assert {r["state"] for r in camp["runs"]} == {"completed"}
    assert camp["api_slots_in_use"] == 0 and camp["max_concurrent"] == 4
    text = _retrain(cli_env, "status", str(tmp_path / "logs"), timeout=60)
    assert "exp" in text.stdout and "rloo_s2" in text.stdout

    again = _retrain(cli_env, "run", str(path))  # same TOML: finds the campaign, nothing to run
    assert again.returncode == 0 and "start " not in again.stdout


def test_sigkilled_worker_fails_others_complete_and_rerun_runs_only_it(tmp_path, cli_env,
                                                                       tiny_model):
    path = _toml(tmp_path, max_steps=3, seeds="[1, 2]", max_workers=4, stagger=0.0)
    runner = subprocess.Popen([sys.executable, "-m", "retrain", "run", str(path)], env=cli_env,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    victim_dir = tmp_path / "logs" / "exp" / "rloo_s1"
    deadline = time.monotonic() + 120
    while True:  # kill it mid-training: after its first step, before its last
        state = runlog.load_state(victim_dir)
        if state is not None and state.status == "running" and state.step >= 1:
            break
        assert time.monotonic() < deadline and runner.poll() is None, "victim never started"
        time.sleep(0.05)
    victim = load_manifest(tmp_path / "logs" / "exp").entry("rloo_s1")
    assert victim.pid == state.pid
    subprocess.run(["kill", "-KILL", str(victim.pid)], check=True)
    out, _ = runner.communicate(timeout=300)
    assert runner.returncode == 1, out
    assert "killed by SIGKILL" in out and "1 run(s) failed" in out
    m = load_manifest(tmp_path / "logs" / "exp")
    assert m.status == "failed"
    by = {r.name: r for r in m.runs}
    assert (by["rloo_s1"].status, by["rloo_s1"].exit_code) == ("failed", -signal.SIGKILL)
    assert all(by[n].status == "completed" for n in ("grpo_s1", "grpo_s2", "rloo_s2"))

    again = _retrain(cli_env, "run", str(path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert re.findall(r"\] start (\S+)", again.stdout) == ["rloo_s1"]
    m = load_manifest(tmp_path / "logs" / "exp")
    assert m.status == "completed"
    assert {r.name: r.attempts for r in m.runs} == {"grpo_s1": 1, "grpo_s2": 1, "rloo_s1": 2,
                                                    "rloo_s2": 1}
    rows = runlog.read_metrics(victim_dir / "metrics.jsonl").rows
    assert [row["step"] for row in rows] == [1, 2, 3]  # resumed from its checkpoint, no repeats
