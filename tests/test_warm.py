"""tests/warm.py: a `python -m retrain` forked from the warm zygote is a process of its own,
with the working folder, environment, streams, session, command line and exit status it was
asked for, as a cold one has; what it cannot honour starts cold; a warm campaign runner's
workers are warm too. Each run here is the tiny model's, 1 step,
whose reward (in the run's scorer process) writes down what it sees of the run's process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests import warm  # noqa: E402
from tests.run_helpers import write_config  # noqa: E402

SEEN = '''
import json, os
from pathlib import Path


def reward(completion, answer):
    """Write down the run process (this scorer's parent): its folder, a variable, its command
    line, its parent and session; once per process."""
    run = os.getppid()
    out = Path(os.environ["SEEN_DIR"]) / f"{run}.json"
    if not out.exists():
        stat = Path(f"/proc/{run}/stat").read_text().rsplit(")", 1)[1].split()
        out.write_text(json.dumps({
            "pid": run, "ppid": int(stat[1]), "sid": int(stat[3]),
            "cwd": os.readlink(f"/proc/{run}/cwd"), "marker": os.environ.get("MARKER"),
            "cmdline": Path(f"/proc/{run}/cmdline").read_bytes().decode().split("\\0"),
        }))
    return 1.0
'''

ONE_STEP = {"max_steps": 1, "save_every": 1, "batch_size": 1, "group_size": 2, "max_tokens": 4}


@pytest.fixture
def room(monkeypatch):
    """Room for one more zygote in this pytest worker, whatever earlier tests started."""
    monkeypatch.setattr(warm, "MAX_ZYGOTES", len(warm._zygotes) + 1)


def _config(folder: Path, name: str = "run", training: dict = ONE_STEP) -> Path:
    (folder / "seen.py").write_text(SEEN)
    return write_config(folder, name, reward={"function": "seen.py:reward"},
                        training=training, data={"eval_size": 0})


def _seen(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def _env(cli_env: dict, seen: Path, **extra: str) -> dict:
    seen.mkdir(exist_ok=True)
    return {**cli_env, "SEEN_DIR": str(seen), "MARKER": "asked-for", **extra}


def test_a_warm_run_is_its_own_process_as_asked(tmp_path, cli_env, tiny_model, room):
    path = _config(tmp_path)
    with warm.Popen([sys.executable, "-m", "retrain", path.name], cwd=tmp_path,
                    env=_env(cli_env, tmp_path / "seen"), stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
        assert isinstance(proc, warm.WarmProcess)
        out = proc.stdout.read()
    assert proc.returncode == 0, out
    assert "finished 1 steps" in out
    (seen,) = _seen(tmp_path / "seen")
    assert seen["pid"] == proc.pid != os.getpid()
    assert seen["ppid"] == proc.zygote_pid              # forked by the zygote
    assert seen["sid"] == proc.pid                       # start_new_session
    assert seen["cwd"] == str(tmp_path) and seen["marker"] == "asked-for"
    assert seen["cmdline"][:4] == [sys.executable, "-m", "retrain", path.name]
    assert warm.CPU_S[0] > 0


def test_exit_status_stderr_and_signals_are_a_processes(tmp_path, cli_env, tiny_model, room):
    done = warm.run([sys.executable, "-m", "retrain", "nope.toml"], cwd=tmp_path, env=cli_env,
                    capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("error: nope.toml: no such file")
    path = _config(tmp_path, training={**ONE_STEP, "max_steps": 10_000})
    proc = warm.Popen([sys.executable, "-m", "retrain", path.name], cwd=tmp_path,
                      env=_env(cli_env, tmp_path / "seen"), stdout=subprocess.DEVNULL)
    assert isinstance(proc, warm.WarmProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL


def test_what_a_fork_cannot_honour_starts_cold(cli_env, room):
    version = [sys.executable, "-m", "retrain", "--version"]
    hot = warm.Popen(version, env=cli_env, stdout=subprocess.PIPE)
    cold = [warm.Popen(version, env={**cli_env, "OMP_NUM_THREADS": "3"},  # read as OpenMP loads
                       stdout=subprocess.PIPE),
            warm.Popen([sys.executable, "-W", "default", "-m", "retrain", "--version"],
                       env=cli_env, stdout=subprocess.PIPE),
            warm.Popen(version, env=cli_env, stdout=subprocess.PIPE, close_fds=False)]
    assert isinstance(hot, warm.WarmProcess)
    assert all(type(p) is subprocess.Popen for p in cold)
    outputs = {p.communicate(timeout=60)[0].strip() for p in [*cold, hot]}
    assert len(outputs) == 1 and outputs.pop().startswith(b"retrain")


def test_variables_read_at_run_time_do_not_matter(cli_env, room):
    version = [sys.executable, "-m", "retrain", "--version"]
    leaked = {**cli_env, "PYTHONBREAKPOINT": "0", "HF_HUB_OFFLINE": "1",
              "TORCHINDUCTOR_CACHE_DIR": "/nowhere"}
    procs = [warm.Popen(version, env=env, stdout=subprocess.PIPE) for env in (cli_env, leaked)]
    assert all(isinstance(p, warm.WarmProcess) for p in procs)
    assert procs[0].zygote_pid == procs[1].zygote_pid
    assert all(p.communicate(timeout=60)[0].startswith(b"retrain") for p in procs)


CAMPAIGN = """
[campaign]
seeds = [1, 2]
parallel = true
max_workers = 2
"""


def test_a_warm_campaign_runner_launches_warm_workers(tmp_path, cli_env, tiny_model, room):
    path = _config(tmp_path, "camp")
    path.write_text(path.read_text() + CAMPAIGN)
    env = _env(cli_env, tmp_path / "seen")
    runner = warm.Popen([sys.executable, "-m", "retrain", path.name], cwd=tmp_path, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = runner.communicate(timeout=300)
    assert isinstance(runner, warm.WarmProcess) and runner.returncode == 0, out
    workers = _seen(tmp_path / "seen")
    assert len(workers) == 2
    for worker in workers:
        assert worker["cmdline"][:4] == [sys.executable, "-m", "retrain", "run"]
        assert worker["cmdline"][4].endswith("config.toml")   # the adoption check reads this
        assert worker["sid"] == worker["pid"]
        assert worker["ppid"] == runner.zygote_pid, worker   # not the runner's child
