"""Exact resume: 6 steps straight == 3 steps, SIGKILL, resume 3 more (fp32, fixed seed): the
same tokens and rewards, the same losses to float rounding."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

pytest.importorskip("torch")

from retrain.config.loader import load_config  # noqa: E402
from retrain.run.single import run_single  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import (  # noqa: E402
    rows,
    run_in_process,
    same_rows,
    state,
    wait_for,
    write_config,
)

COMPARED = ("batch_size", "num_completions", "mean_reward", "reward_std", "loss", "grad_norm",
            "mean_completion_tokens", "sampler_trainer_logprob_diff", "max_token_hit_rate")


def test_kill_and_resume_repeats_the_uninterrupted_run(tmp_path, monkeypatch, cli_env, python,
                                                      tiny_model):
    monkeypatch.chdir(tmp_path)
    steps = {"max_steps": 6, "batch_size": 2, "group_size": 4, "max_tokens": 12}
    path = write_config(tmp_path, training=steps, data={"eval_size": 0})
    assert run_single(load_config(path, {"logging.log_dir": "straight"}), path) == 0
    straight = rows(tmp_path / "straight" / "run")

    counter = tmp_path / "calls"
    env = dict(cli_env, RETRAIN_TEST_COUNTER=str(counter),
               RETRAIN_TEST_BLOCK_AFTER=str(3 * 2 * 4))  # blocks in step 4's first reward call
    cmd = [python, "-m", "retrain", "run", str(path), "--log-dir", "killed"]
    proc = warm.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
    run_dir = tmp_path / "killed" / "run"
    try:
        wait_for(lambda: counter.exists() and int(counter.read_text() or 0) > 24, proc)
        assert state(run_dir)["step"] == 3 and state(run_dir)["status"] == "running"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(rows(run_dir)) == 3

    done = run_in_process(cmd[3:], tmp_path)  # the resume: in this process
    assert done.returncode == 0, done.stderr
    assert "resuming" in done.stdout and "after step 3" in done.stdout
    resumed = rows(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    same_rows(straight, resumed, COMPARED)
    assert state(run_dir)["status"] == "completed"
