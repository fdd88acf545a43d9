"""A run on two CPU ranks (gloo, 1 thread each) through the real CLI: started by `retrain`
itself ([distributed] nproc_per_node = 2) or by torchrun, it equals the same run in one
process (rows, the adapter to float32 rounding, the run folder), as two "nodes" on localhost
and started by `retrain` after an interrupted and a failed launch: Ctrl-C stops every rank and
leaves a resumable run; a rank killed mid-run stops the launcher within a bounded time, naming
the rank; the rerun resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.run_helpers import rows, run_in_process, wait_until, write_config

STEPS = 5
# batch_size 3 on 2 ranks: 2 groups on rank 0 and 1 on rank 1 (uneven splits work)
TRAINING = {"max_steps": STEPS, "batch_size": 3, "save_every": 1}
# Times, memory and where the run ran are the process's; the rest must be the same.
OWN = ("time", "_s", "rss", "load_average", "tokens_per_second", "world_size", "cpu_threads",
       "others_busy_cores")


# What the completions decide: equal to the bit. The rest (losses, gradient norms, log-prob
# gaps) is float32 arithmetic over other batch shapes and summation orders: equal to its
# rounding, which a few AdamW steps carry to ~1e-6 relative (seen: 1.6e-6 on a grad norm).
SAMPLED = ("mean_reward", "reward_std", "correct_rate", "num_completions", "sampled_tokens",
           "prefill_tokens", "trained_tokens", "mean_completion_tokens", "max_token_hit_rate",
           "trained_completions", "reward_uniform_group_rate", "batch_size", "lr",
           "eval_accuracy", "initial_eval_accuracy")


def _same_row(want: dict, got: dict) -> None:
    keys = _science(want)
    assert {k: got[k] for k in SAMPLED if k in want} == {k: want[k] for k in SAMPLED
                                                          if k in want}, want["step"]
    assert {k: got[k] for k in keys} == pytest.approx({k: want[k] for k in keys}, rel=1e-4,
                                                       abs=1e-5), want["step"]


def _science(row: dict) -> tuple[str, ...]:
    return tuple(k for k, v in row.items() if isinstance(v, (int, float)) and not any(
        o in k for o in OWN))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_cache) -> Path:
    """The run in one process (in this one: it spares a process's start)."""
    folder = tmp_path_factory.mktemp("one")
    write_config(folder, "run", training=TRAINING)
    done = run_in_process(["run.toml"], folder, {"RETRAIN_CACHE": str(model_cache)})
    assert done.returncode == 0, done.stderr
    return folder / "logs" / "run"


TWO_RANKS = {"nproc_per_node": 2}


def _torchrun(python: str, *args: str) -> list[str]:
    return [python, "-m", "torch.distributed.run", *args, "-m", "retrain", "run.toml"]


def _same_run(reference: Path, run_dir: Path, steps: int = STEPS) -> None:
    want, got = rows(reference)[:steps], rows(run_dir)
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        _same_row(a, b)
    assert [r["world_size"] for r in got] == [2] * len(got)
    assert [r["world_size"] for r in want] == [1] * len(want)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(p.name for p in reference.iterdir())
    _same_adapter(reference / "checkpoints" / f"step-{steps:06d}",
                  run_dir / "checkpoints" / f"step-{steps:06d}")


def _same_adapter(a: Path, b: Path) -> None:
    import torch
    from safetensors.torch import load_file

    want, got = (load_file(p / "adapter_model.safetensors") for p in (a, b))
    assert want.keys() == got.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5, msg=name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_equal_one_process(tmp_path, reference, cli_env, python):
    """torchrun --nnodes 2 as a user starts a job on two machines, here both on localhost,
    each node with its own folder (rank 0's is the run's)."""
    port = _free_port()
    nodes = []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        write_config(folder, "run", training=TRAINING)
        nodes.append(subprocess.Popen(
            _torchrun(python, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                      "1", "--master-addr", "127.0.0.1", "--master-port", str(port)),
            cwd=folder, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    _same_run(reference, tmp_path / "node0" / "logs" / "run")
    assert not (tmp_path / "node1" / "logs").exists()  # no rank but 0 writes


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
    _same_run(reference, folder / "logs" / "run")
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
