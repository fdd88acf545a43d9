"""Helpers shared by the trainer tests: tiny-model configs and reading run folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests import warm

REPO = Path(__file__).resolve().parents[1]

DIGITS_REWARD = '''
import os, time
from pathlib import Path


def reward(completion, answer):
    """Fraction of digit characters: a reward the tiny model can learn."""
    counter = os.environ.get("RETRAIN_TEST_COUNTER")
    if counter:  # the resume test blocks the run here to kill it at a known point
        path = Path(counter)
        calls = int(path.read_text()) + 1 if path.exists() else 1
        path.write_text(str(calls))
        if calls > int(os.environ["RETRAIN_TEST_BLOCK_AFTER"]):
            # Block until the run is killed: the scorer may live in a child process, which
            # must then notice that its parent is gone instead of lingering for long.
            parent, deadline = os.getppid(), time.monotonic() + 300
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(0)
    delay = float(os.environ.get("RETRAIN_TEST_REWARD_DELAY", "0"))
    if delay:
        time.sleep(delay)
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0


def flaky(completion, answer):
    if "1" in completion:
        raise ValueError("this scorer breaks on ones")
    return 0.5 if len(completion) % 2 else 1.0


def constant(completion, answer):
    return 1.0
'''

BASE = {
    "model": {"name": "tiny-random", "dtype": "float32", "threads": 1, "lora_rank": 8},
    "data": {"source": "arithmetic", "eval_size": 8},
    "reward": {"type": "custom", "function": "digits.py:reward", "timeout_s": 600.0},
    "training": {"batch_size": 2, "group_size": 4, "max_tokens": 8, "max_steps": 4,
                 "lr": 1e-2, "save_every": 2, "seed": 3},
    "logging": {"log_dir": "logs"},
}


def write_config(folder: Path, name: str = "run", **sections: dict) -> Path:
    """A tiny-model config in `folder` (with the digits reward next to it); returns its path."""
    from retrain.config import toml_io

    (folder / "digits.py").write_text(DIGITS_REWARD)
    raw = {k: dict(v) for k, v in BASE.items()}
    if sections.get("environment", {}).get("kind", "task") != "task":
        # another kind asks its own questions and scores them: no [reward], no task [data]
        del raw["reward"]
        raw["data"] = {"eval_size": raw["data"]["eval_size"]}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path = folder / f"{name}.toml"
    path.write_text(toml_io.dumps(raw))
    return path


def run_in_process(argv: list, cwd: Path, env: dict[str, str] | None = None
                   ) -> subprocess.CompletedProcess:
    """`retrain ARGV` run in this process from `cwd`, with `env` added to the environment for
    its length: for tests of what a run does, not of the process it runs in. It spares the
    ~6 CPU-seconds a fresh process spends importing torch, transformers and peft."""
    import contextlib
    import io
    from unittest import mock

    from retrain.cli.app import run_app

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.chdir(cwd), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_app([str(a) for a in argv])
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def same_rows(want: list[dict], got: list[dict], keys: tuple[str, ...]) -> None:
    """`got`'s metrics rows are `want`'s, step by step: counts, rewards and tokens exactly (to
    1e-6), float figures to float32's rounding. A resumed process may round a loss or a
    gradient norm differently in its last bits (seen: 3.3e-8 vs 6.8e-8 for a loss that
    cancels to ~0), and a test must not depend on those; a resume that lost state is off by
    orders more."""
    import pytest

    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-6,
                                                        abs=1e-6), a["step"]


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def newest_resume_point(run_dir: Path) -> dict:
    """The newest of state.json and the checkpoints' own resume points (checkpoints/step-N.json),
    as a resume picks it: a process frozen between a step's checkpoint and its state.json holds
    a resume point one step ahead of state.json."""
    points = [state(run_dir), *(json.loads(p.read_text())
                                for p in (run_dir / "checkpoints").glob("step-*.json"))]
    return max(points, key=lambda point: point["step"])


def read_serve_url(proc, timeout_s: float) -> str:
    """The URL a `retrain serve --port 0` process prints on stderr once it listens."""
    line, deadline = "", time.monotonic() + timeout_s
    while "retrain serve: http://" not in line and time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "retrain serve exited"
    return line.split("retrain serve: ")[1].split()[0]


@dataclass
class ServeProcess:
    """A running `retrain serve`: its base URL and what it printed on stderr so far."""

    url: str
    lines: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "".join(self.lines)


@contextmanager
def serve_process(cache: Path, state: Path, *args: str,
                  timeout_s: float = 120) -> Iterator[ServeProcess]:
    """`retrain serve --model tiny-random` as users start it, on a free port, with `args`
    added (e.g. --adapter); stopped with SIGTERM at the end. Its stderr is read on in a thread,
    so a chatty server never blocks on a full pipe."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RETRAIN_CACHE": str(cache),
           "RETRAIN_SERVE_DIR": str(state), "PYTHONUNBUFFERED": "1"}
    env.pop("RETRAIN_SERVE_API_KEY", None)
    proc = warm.Popen([sys.executable, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0", "--dtype", "float32", *args],
                      env=env, stderr=subprocess.PIPE, text=True)
    try:
        served = ServeProcess(read_serve_url(proc, timeout_s))
        reader = threading.Thread(target=lambda: served.lines.extend(proc.stderr),
                                  daemon=True)
        reader.start()
        yield served
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_until(predicate, timeout: float, what: str, detail=None):
    """Poll `predicate` until it returns something true (returned); fail naming `what`, with
    `detail()` (e.g. the logs of the processes waited on) when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    said = f"\n{detail()}" if detail is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{said}")


def wait_for(predicate, proc, timeout=120.0):
    """Poll `predicate` until true; fail early with the output if the process `proc` ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the run exited early ({proc.returncode}): {out}")
        time.sleep(0.05)
    raise AssertionError("timed out waiting for the run")


def kill_after_step_3_and_resume(path: Path, cli_env: dict, python: str, calls: int,
                                 log_dir: str = "killed") -> list[dict]:
    """Run `path` with `python -m retrain run` into `log_dir`, blocked in the reward call after
    `calls` calls (step 4's first), SIGKILL it there (state at step 3), run the same command
    again in this process to resume, and return the resumed run's rows."""
    import os
    import signal
    import subprocess

    counter = Path(path).parent / "calls"
    env = dict(cli_env, RETRAIN_TEST_COUNTER=str(counter), RETRAIN_TEST_BLOCK_AFTER=str(calls))
    cmd = [python, "-m", "retrain", "run", str(path), "--log-dir", log_dir]
    proc = warm.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
    run_dir = Path(path).parent / log_dir / "run"
    try:
        wait_for(lambda: counter.exists() and int(counter.read_text() or 0) > calls, proc,
                 timeout=300)
        assert state(run_dir)["step"] == 3
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = run_in_process(cmd[3:], Path.cwd())  # the resume: in this process
    assert done.returncode == 0, done.stderr
    return rows(run_dir)
