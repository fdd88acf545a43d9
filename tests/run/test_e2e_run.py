"""End to end: the real CLI (`python -m retrain FILE.toml`) in a temporary folder, tiny model."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests import warm
from tests.run_helpers import rows, run_in_process, state, write_config


def retrain(python, env, cwd, *args, timeout=300):
    return warm.run([python, "-m", "retrain", *args], cwd=cwd, env=env,
                    capture_output=True, text=True, timeout=timeout)


def test_train_then_rerun_says_finished(tmp_path, cli_env, python, tiny_model):
    path = write_config(tmp_path, "quick", training={"max_steps": 3})
    done = retrain(python, cli_env, tmp_path, path.name)
    assert done.returncode == 0, done.stderr
    assert "eval accuracy before training" in done.stdout
    assert "step 3/3" in done.stdout and "finished 3 steps" in done.stdout
    run_dir = tmp_path / "logs" / "quick"
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3]
    assert "eval_accuracy" in rows(run_dir)[-1]
    assert state(run_dir)["status"] == "completed"
    assert (run_dir / "config.toml").exists()
    assert (run_dir / "checkpoints" / "step-000003" / "adapter_model.safetensors").exists()
    again = retrain(python, cli_env, tmp_path, path.name)
    assert again.returncode == 0 and "already finished" in again.stdout
    assert len(rows(run_dir)) == 3
    # the resolved config is re-runnable as is: it names the same run, which is finished
    third = retrain(python, cli_env, tmp_path, str(run_dir / "config.toml"))
    assert third.returncode == 0 and "already finished" in third.stdout


@pytest.mark.parametrize(("setup", "expected"), [
    ({"data": {"source": "jsonl", "path": "broken.jsonl"}}, "broken.jsonl:2"),
    ({"reward": {"function": "no_such_module:reward"}}, "reward.function"),
    ({"reward": {"function": "digits.py:missing"}}, "has no function 'missing'"),
])
def test_bad_inputs_exit_2_with_a_clear_message(tmp_path, cli_env, python, setup, expected):
    (tmp_path / "broken.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n{"prompt": \n')
    path = write_config(tmp_path, "bad", **setup)
    done = retrain(python, cli_env, tmp_path, path.name)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "logs" / "bad" / "metrics.jsonl").exists()


def test_sigterm_checkpoints_and_the_next_launch_resumes(tmp_path, cli_env, python, tiny_model):
    path = write_config(tmp_path, "stop", training={"max_steps": 6}, data={"eval_size": 0})
    env = dict(cli_env, RETRAIN_TEST_REWARD_DELAY="0.15")  # ~1 s per step
    proc = warm.Popen([python, "-m", "retrain", path.name], cwd=tmp_path, env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "stop"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((run_dir / "state.json").read_text())["step"] >= 1:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out, err)
    assert "Resume with the same command" in err
    st = state(run_dir)
    assert st["status"] == "interrupted" and 1 <= st["step"] < 6
    assert [r["step"] for r in rows(run_dir)] == list(range(1, st["step"] + 1))
    done = run_in_process([path.name], tmp_path)  # the next launch: in this process
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert state(run_dir)["status"] == "completed"


def test_a_single_run_never_lands_in_or_moves_a_campaigns_folder(tmp_path, cli_env, python,
                                                                  tiny_model):
    """A campaign and a single run both default to the file's stem: remove [campaign] from
    exp.toml and its single run (with or without --new) is refused, the campaign untouched."""
    path = write_config(tmp_path, "exp", training={"max_steps": 1}, data={"eval_size": 0},
                        campaign={"seeds": [3]})
    done = retrain(python, cli_env, tmp_path, path.name)
    assert done.returncode == 0, done.stderr
    camp = tmp_path / "logs" / "exp"
    before = sorted(p.relative_to(camp) for p in camp.rglob("*"))
    assert (camp / "manifest.json").is_file()
    path.write_text(path.read_text().replace("[campaign]\nseeds = [3]\n", ""))
    assert "[campaign]" not in path.read_text()
    for args in ([path.name], [path.name, "--new"]):
        done = retrain(python, cli_env, tmp_path, *args)
        assert done.returncode == 2, done.stdout + done.stderr
        err = done.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "logs/exp holds a campaign (manifest.json)" in err and "logging.run_name" in err
    assert sorted(p.relative_to(camp) for p in camp.rglob("*")) == before
    assert [p.name for p in (tmp_path / "logs").iterdir() if ".prev-" in p.name] == []
    renamed = retrain(python, cli_env, tmp_path, path.name, "--set", "logging.run_name=solo")
    assert renamed.returncode == 0, renamed.stderr
    assert (tmp_path / "logs" / "solo" / "metrics.jsonl").is_file()
