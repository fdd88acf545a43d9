"""A Ray campaign with no cluster running starts its own on this machine (`ray start --head`,
campaign/ray_cluster.py), which outlives the runner: SIGKILL the runner and the runs keep
going; run the command again and it reuses the cluster, adopts the runs, finishes, and stops
the cluster, leaving no Ray process behind.

Real Ray, real CLI, tiny model. Ray's folders go to a fresh short TMPDIR, so the runner can
find no other cluster of this machine (a `ray start` of the user's, or another test's).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'retrain[ray]')")

from bench.campaign.tiny import tiny_campaign_toml  # noqa: E402
from retrain.campaign import ray_cluster  # noqa: E402
from retrain.campaign.manifest import load_manifest  # noqa: E402
from retrain.runfiles import runlog  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import wait_until  # noqa: E402

REWARD = """
import os, time
def reward(completion, answer):
    time.sleep(float(os.environ.get("RETRAIN_TEST_REWARD_DELAY", "0")))
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0
"""
TABLES = """
[reward]
type = "custom"
function = "{function}:reward"
timeout_s = 600.0
"""
STEPS = 6


@pytest.fixture
def ray_tmp():
    """A short private temp folder (Ray's socket paths must stay under ~100 characters)."""
    path = Path(tempfile.mkdtemp(prefix="rr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ray_processes(ray_tmp: Path) -> list[int]:
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(ray_tmp).encode() in cmd:
            out.append(int(entry.name))
    return out


def _steps(run_dir: Path) -> list[int]:
    lines = (run_dir / runlog.METRICS_FILE).read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def _progress(campaign: Path) -> dict[str, int]:
    """Each running run's step, once every run is placed and past step 1."""
    if not (campaign / runlog.MANIFEST_FILE).exists():
        return {}
    m = load_manifest(campaign)
    out = {}
    for e in m.runs:
        state = runlog.load_state(campaign / e.name)
        if e.status != "running" or not e.node or state is None or state.step < 1:
            return {}
        out[e.name] = state.step
    return out


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc})"


def _what_happened(campaign: Path, out: Path) -> str:
    """The runner's output, the manifest, Ray's log and each run's worker log: what a failed
    wait shows, since a campaign that never got going says why only there."""
    parts = [f"--- runner ({out.name}) ---", _tail(out),
             "--- manifest ---", _tail(campaign / runlog.MANIFEST_FILE),
             f"--- {ray_cluster.LOG} ---", _tail(campaign / ray_cluster.LOG)]
    for log in sorted(campaign.glob("*/worker.log")):
        parts += [f"--- {log.parent.name}/worker.log ---", _tail(log)]
    return "\n".join(parts)


def _wait_placed(runner: subprocess.Popen, campaign: Path, out: Path,
                 what: str) -> dict[str, int]:
    """`_progress` once every run is placed and past step 1; failing with what happened
    (`out` is the runner's output) if the runner exits first or 240 s pass."""
    def placed() -> dict[str, int]:
        if runner.poll() is not None:
            raise AssertionError(f"the runner exited ({runner.returncode}) before {what}\n"
                                 f"{_what_happened(campaign, out)}")
        return _progress(campaign)

    return wait_until(placed, 240, what, lambda: _what_happened(campaign, out))


def _clean_up(runner: subprocess.Popen, campaign: Path, own) -> None:
    """Whatever a failed test left: the runner's process group and the campaign's cluster."""
    if runner.poll() is None:
        os.killpg(runner.pid, signal.SIGKILL)
    leftover = ray_cluster._read(campaign / ray_cluster.RECORD) or own
    if leftover is not None:
        ray_cluster.stop(campaign, leftover)


def _ray_campaign(tmp_path: Path, cli_env: dict, ray_tmp: Path, seeds: str,
                  workers: int) -> tuple[dict, Path, Path]:
    """(environment, TOML, campaign folder) of a tiny Ray campaign with no cluster to find:
    the runner must start its own, in `ray_tmp`."""
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None \
            and shutil.which("ray") is None:
        pytest.skip("the `ray` command is not installed")
    env = {k: v for k, v in cli_env.items() if k != "RAY_ADDRESS"}
    env.update(TMPDIR=str(ray_tmp), RAY_TMPDIR=str(ray_tmp))
    (tmp_path / "score.py").write_text(REWARD)
    path = tmp_path / "exp.toml"
    path.write_text(tiny_campaign_toml(
        tmp_path / "logs", seeds, max_steps=STEPS, max_workers=workers,
        training="save_every = 1", campaign='executor = "ray"',
        tables=TABLES.format(function=tmp_path / "score.py")))
    return env, path, tmp_path / "logs" / "exp"


def test_killed_runner_leaves_its_own_cluster_and_runs_going(tmp_path, cli_env, ray_tmp):
    env, path, campaign = _ray_campaign(tmp_path, cli_env, ray_tmp, "[1, 2]", workers=2)
    own = None
    with open(tmp_path / "first.txt", "w") as out:
        runner = warm.Popen([sys.executable, "-m", "retrain", str(path)],
                            env={**env, "RETRAIN_TEST_REWARD_DELAY": "0.5"},
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        before = _wait_placed(runner, campaign, tmp_path / "first.txt",
                              "both runs placed and at step 1")
        own = ray_cluster._read(campaign / ray_cluster.RECORD)
        assert own is not None and own.pgid != runner.pid
        assert os.getpgid(runner.pid) != own.pgid  # the cluster is not the runner's group
        os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()
        time.sleep(4)  # a cluster owned by the runner would have taken its runs down by now
        assert own.processes(), "the campaign's cluster died with its runner"
        mid = _progress(campaign)
        assert set(mid) == set(before)
        explain = warm.run([sys.executable, "-m", "retrain", "explain", str(path)],
                           env=env, capture_output=True, text=True, timeout=120)
        assert f"the campaign's own cluster at {own.address}" in explain.stdout, \
            explain.stdout + explain.stderr
        for name in mid:  # the run processes are alive, and they keep stepping
            state = runlog.load_state(campaign / name)
            assert runlog.pid_alive(state.pid, state.host), name
        wait_until(lambda: (p := _progress(campaign)) and all(
            p[name] > step for name, step in mid.items()), 120,
            "the runs to keep stepping without their runner")
        again = warm.run([sys.executable, "-m", "retrain", str(path)], env=env,
                         capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stdout + again.stderr
        m = load_manifest(campaign)
        assert m.status == "completed"
        for e in m.runs:  # adopted, not started twice; every step exactly once
            assert e.status == "completed" and e.attempts == 1, e
            assert _steps(campaign / e.name) == list(range(1, STEPS + 1))
        # The campaign is over: its cluster is stopped, forgotten, and nothing of Ray is left.
        assert not (campaign / ray_cluster.RECORD).exists()
        wait_until(lambda: not ray_cluster._group_members(own.pgid)
                  and not _ray_processes(ray_tmp), 30, "the cluster's processes to exit")
    finally:
        _clean_up(runner, campaign, own)


def test_interrupted_runner_stops_its_own_cluster(tmp_path, cli_env, ray_tmp):
    """Ctrl-C: the runs checkpoint and stop, and with nothing of the campaign running the
    runner stops the cluster it started; nothing of Ray is left."""
    env, path, campaign = _ray_campaign(tmp_path, cli_env, ray_tmp, "[1]", workers=1)
    env["RETRAIN_TEST_REWARD_DELAY"] = "0.5"
    with open(tmp_path / "out.txt", "w") as out:
        runner = warm.Popen([sys.executable, "-m", "retrain", str(path)], env=env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    own = None
    try:
        _wait_placed(runner, campaign, tmp_path / "out.txt", "the run placed and at step 1")
        own = ray_cluster._read(campaign / ray_cluster.RECORD)
        assert own is not None
        runner.send_signal(signal.SIGINT)
        assert runner.wait(timeout=120) == 130, (tmp_path / "out.txt").read_text()
        assert not (campaign / ray_cluster.RECORD).exists()
        wait_until(lambda: not ray_cluster._group_members(own.pgid)
                  and not _ray_processes(ray_tmp), 30, "the cluster's processes to exit")
    finally:
        _clean_up(runner, campaign, own)
