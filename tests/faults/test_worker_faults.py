"""A reward or environment worker killed from outside, and SIGTERM to the whole process group:
real runs of the tiny model, signalled at a known call of the worker (a call counter in a file
next to the config). The SIGTERM run is a `python -m retrain` process in its own session (the
process group is what it tests); a killed worker's run runs in the test's process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests import warm  # noqa: E402
from tests.run_helpers import rows, run_in_process, state, write_config  # noqa: E402

STEPS = {"max_steps": 3, "save_every": 2, "batch_size": 2, "group_size": 4, "max_tokens": 6}
CALLS_PER_STEP = 8  # batch_size x group_size, no eval

WORKER_CODE = '''
import linecache, os, signal, sys, threading, time
from pathlib import Path

from retrain.environments import Environment, Step

MARKER = Path(__file__).with_name("calls.txt")


def _on_call() -> None:
    """Count this call of the run; at the chosen one, do the chosen harm."""
    calls = int(MARKER.read_text()) + 1 if MARKER.exists() else 1
    MARKER.write_text(str(calls))
    if calls != int(os.environ["RETRAIN_TEST_ON_CALL"]):
        return
    if os.environ["RETRAIN_TEST_ACTION"] == "sigterm-group":  # timeout, scancel, kill -- -PGID
        os.killpg(os.getpgid(0), signal.SIGTERM)
        time.sleep(0.2)
        return
    main = threading.main_thread().ident

    def kill_when_idle():  # the OOM killer, while the worker waits for its next request
        while True:
            frame = sys._current_frames()[main]
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            if frame.f_code.co_name == "main" and "in sys.stdin" in line:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.001)

    threading.Thread(target=kill_when_idle, daemon=True).start()


def reward(completion, answer):
    _on_call()
    return 1.0


class OneTurn(Environment):
    def reset(self, seed):
        return [{"role": "user", "content": f"say something ({seed})"}]

    def step(self, reply):
        return Step(reward=1.0, done=True)

    def close(self):
        _on_call()
        return 0.0
'''


def prepare(folder: Path, action: str, on_call: int, kind: str = "task") -> dict[str, str]:
    """The worker and run.toml in `folder`; returns the variables that arm the worker."""
    (folder / "worker.py").write_text(WORKER_CODE)
    sections = {"environment": {"kind": "python", "factory": "worker.py:OneTurn"}} \
        if kind == "python" else {"reward": {"function": "worker.py:reward"}}
    write_config(folder, training=STEPS, data={"eval_size": 0}, **sections)
    return {"RETRAIN_TEST_ACTION": action, "RETRAIN_TEST_ON_CALL": str(on_call)}


def start(folder: Path, env: dict, action: str, on_call: int):
    env = {**env, **prepare(folder, action, on_call)}
    # Its own session: the process group is the run's, not pytest's.
    return warm.Popen([sys.executable, "-m", "retrain", "run.toml"], cwd=folder,
                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True, start_new_session=True)


@pytest.mark.parametrize("kind, failures", [("task", "reward_failures"),
                                            ("python", "env_errors")])
def test_a_worker_killed_between_calls_is_replaced_and_the_run_completes(
        tmp_path, tiny_model, kind, failures):
    armed = prepare(tmp_path, "kill", CALLS_PER_STEP, kind)  # idle after step 1
    proc = run_in_process(["run.toml"], tmp_path, armed)
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert "died between calls (killed by SIGKILL: out of memory?)" in err
    assert "Traceback" not in err
    got = rows(tmp_path / "logs" / "run")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r[failures] for r in got] == [0, 0, 0]  # the next call went to the new worker
    assert state(tmp_path / "logs" / "run")["status"] == "completed"


def test_sigterm_to_the_process_group_stops_like_ctrl_c(tmp_path, cli_env, tiny_model):
    """The worker lives through it; the trainer finishes step 2, checkpoints and exits 143
    (resumable: tests/faults/test_faults.py resumes an interrupted run)."""
    proc = start(tmp_path, cli_env, "sigterm-group", CALLS_PER_STEP + 3)  # inside step 2
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and "died" not in err
    run_dir = tmp_path / "logs" / "run"
    assert state(run_dir)["status"] == "interrupted"
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2]
    assert [r["reward_failures"] for r in got] == [0, 0]
    assert (run_dir / "checkpoints" / "step-000002").is_dir()
