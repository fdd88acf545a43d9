"""A run on two CPU ranks (gloo, 1 thread each) through the real CLI, started by `retrain`
itself ([distributed] nproc_per_node = 2), after an interrupted and a failed launch, equals
the same run in one process (rows, the adapter to float32 rounding, the run folder): Ctrl-C
stops every rank and leaves a resumable run; a rank killed mid-run stops the launcher within
a bounded time, naming the rank; the rerun resumes exactly. Two "nodes" on localhost:
test_ranked_nodes.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.distributed.ranked import STEPS, TRAINING, TWO_RANKS, same_run
from tests.run_helpers import rows, run_in_process, wait_until, write_config


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's worker with RANK=`rank` (from /proc)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and \
                f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def _start(python: str, folder: Path, env: dict) -> subprocess.Popen:
    """`retrain run.toml` on 2 ranks, slowed (a step takes ~1 s: time to act mid-run), in a
    session of its own (as a terminal's foreground job)."""
    return subprocess.Popen([python, "-m", "retrain", "run.toml"], cwd=folder,
                            env={**env, "RETRAIN_TEST_REWARD_DELAY": "0.05"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _rerun_resumes(python: str, folder: Path, env: dict, reference: Path) -> None:
    done = subprocess.run([python, "-m", "retrain", "run.toml"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming" in done.stdout + done.stderr
    assert done.stdout.count(f"step {STEPS}/{STEPS}") == 1  # rank 0 alone reports
    same_run(reference, folder / "logs" / "run")
    status = run_in_process(["status", "logs/run"], folder)
    assert status.returncode == 0 and f"{STEPS}/{STEPS}" in status.stdout, status.stdout


def _interrupt(launcher: subprocess.Popen, run_dir: Path, after: int, how) -> str:
    """`how(launcher)` once the run has written `after` rows; the launcher's stderr."""
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").exists() and len(rows(run_dir)) >= after,
                   120, f"step {after}'s row")
        how(launcher)
        return launcher.communicate(timeout=120)[1]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_ctrl_c_and_a_killed_rank_each_leave_a_run_that_resumes_exactly(tmp_path, reference,
                                                                        cli_env, python):
    write_config(tmp_path, "run", training=TRAINING, distributed=TWO_RANKS)
    run_dir = tmp_path / "logs" / "run"
    # Ctrl-C in a terminal signals the whole foreground job: launcher and ranks.
    launcher = _start(python, tmp_path, cli_env)
    err = _interrupt(launcher, run_dir, 1, lambda p: os.killpg(p.pid, signal.SIGINT))
    assert launcher.returncode == 128 + signal.SIGINT, err[-2000:]
    assert json.loads((run_dir / "state.json").read_text())["status"] == "interrupted"
    assert _rank_pid(launcher.pid, 1) is None
    # Resumed, then rank 1 is killed: the launcher stops the run within a bounded time.
    done = len(rows(run_dir))
    launcher = _start(python, tmp_path, cli_env)
    start = time.monotonic()
    err = _interrupt(launcher, run_dir, done + 1,
                     lambda p: os.kill(_rank_pid(p.pid, 1), signal.SIGKILL))
    assert launcher.returncode != 0 and time.monotonic() - start < 120, err[-2000:]
    assert len(rows(run_dir)) < STEPS, "the run went on without its rank"
    assert "rank 1" in err and "signal 9" in err, err[-2000:]
    _rerun_resumes(python, tmp_path, cli_env, reference)
