"""The SFT stage with backend = "tinker" against `retrain serve` (tiny model, this process):
the cross_entropy loss over the wire falls, the RL steps follow, and a SIGKILL while an SFT
step's forward_backward hangs at the server resumes exactly."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

pytest.importorskip("tinker")
pytest.importorskip("retrain.run.trainer")

from retrain.serve.door.guard import FaultPlan  # noqa: E402
from tests import warm  # noqa: E402
from tests.run.test_sft_run import check_sft_then_rl, same_phased_rows, sft_config  # noqa: E402
from tests.run_helpers import rows, run_in_process, state, wait_for  # noqa: E402


def test_sft_then_rl_on_serve_and_a_kill_during_sft(tiny_server, tmp_path, tinker_cli_env,
                                                    sdk_env, python):
    path = sft_config(tmp_path, backend={"backend": "tinker", "base_url": tiny_server.url,
                                         "request_timeout_s": 120})
    cmd = [python, "-m", "retrain", "run", str(path), "--log-dir"]
    done = run_in_process([*cmd[3:], "straight"], tmp_path)  # only its rows matter
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    straight = rows(tmp_path / "straight" / "run")
    check_sft_then_rl(straight)

    # SFT step 4's forward_backward hangs at the server: the run is killed there, after 3
    tiny_server.app.faults = FaultPlan(rates={"hang": 1.0},
                                       routes=frozenset({"forward_backward"}), after=3,
                                       limit=1, hang_s=120)
    run_dir = tmp_path / "killed" / "run"
    proc = warm.Popen([*cmd, "killed"], env=tinker_cli_env, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_for(lambda: tiny_server.traffic.faults.get("hang") == 1, proc, timeout=300)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        tiny_server.app.faults = None
        if proc.poll() is None:
            proc.kill()
    killed_at = state(run_dir)
    assert killed_at["step"] == 3 and killed_at["extra"]["phase"] == "sft"
    assert killed_at["checkpoint"].startswith("tinker://")

    resumed = run_in_process([*cmd[3:], "killed"], tmp_path)  # in this process
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-3000:]
    assert "after step 3 (SFT)" in resumed.stdout
    same_phased_rows(straight, rows(run_dir))
